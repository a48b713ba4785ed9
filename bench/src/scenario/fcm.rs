//! The FCM bridge: devices registered through `/v1/fcm/...`, an application
//! server pushing VAPID-signed ~2 KB bodies to them at fixed rates (open
//! loop, see [`crate::open_loop`]), and the local stand-in for Google
//! (`autopush_tests::google`) answering `messages:send` after a fixed delay,
//! in a process of its own. Latency is the sender's: from the moment a POST
//! was due until its 201, which covers the round trip to FCM. Reported per
//! rate: the CPU of the server, of the stand-in and of the generator (each
//! a process), the server's CPU per push, and the access tokens fetched
//! (one per token lifetime is the goal) and the messages Google received
//! (every accepted push).

use std::path::Path;
use std::time::Duration;

use serde_json::json;

use crate::open_loop::{self, Connections, Load};
use crate::server::Server;
use crate::stand_in::StandIn;

pub struct Options {
    pub devices: usize,
    pub connections: usize,
    /// Milliseconds FCM takes to answer, one run each.
    pub delays_ms: Vec<u64>,
    /// Offered pushes per second, in order; 0 is a closed loop.
    pub rates: Vec<u64>,
    pub seconds: u64,
    /// The app's cap on messages in flight to FCM.
    pub max_in_flight: usize,
}

/// Returns whether every push was accepted and reached Google on one token.
pub async fn run(options: &Options, log: &Path) -> bool {
    println!(
        "\n{} FCM devices, {} HTTP/1.1 connections (open loop: at most that many pushes in flight), in-flight cap {}, {} s per rate\n",
        options.devices, options.connections, options.max_in_flight, options.seconds
    );
    println!(
        "| FCM answers after (ms) | offered (/s) | accepted (/s) | p50 (ms) | p99 (ms) | max (ms) | most in flight | server CPU (%) | server CPU per push (µs) | Google CPU (%) | generator CPU (%) | non-201 | reached FCM | token fetches |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|");
    let mut all_good = true;
    for &delay in &options.delays_ms {
        all_good &= run_delay(options, Duration::from_millis(delay), log).await;
    }
    all_good
}

async fn run_delay(options: &Options, delay: Duration, log: &Path) -> bool {
    let google = StandIn::start("google", delay);
    let apps = json!({"bench": {
        "project_id": "autopush-bench",
        "credential": google.info["service_account"].to_string(),
        "base_url": google.base_url,
        "max_in_flight": options.max_in_flight,
    }})
    .to_string();
    // Room on the endpoint port for every connection of the application
    // server (the default is 1 024).
    let max_http = (options.connections + 100).to_string();
    let server = Server::start(
        &[
            "--fcm-credentials",
            &apps,
            "--max-http-connections",
            &max_http,
        ],
        log,
    )
    .await;
    let endpoints = register(&server, options.devices).await;
    let load = Load::new(
        &server.endpoint_url,
        endpoints,
        options.connections,
        options.seconds,
    );
    // The first push fetches the access token; the rates measure what follows.
    open_loop::warm_up(&load).await;
    let mut connections = Connections::open(&load).await;
    let mut all_good = true;
    for &offered in &options.rates {
        let before = google.received().await;
        let (mut measured, open) = open_loop::push_measured(
            &load,
            connections,
            offered,
            || server.cpu_ticks(),
            || google.cpu_ticks(),
        )
        .await;
        connections = open;
        let stats = google.stats().await;
        let reached = stats["received"].as_u64().unwrap_or(0) - before;
        let token_fetches = stats["token_fetches"].as_u64().unwrap_or(0);
        println!(
            "| {} | {} | {reached} | {token_fetches} |",
            delay.as_millis(),
            measured.cells()
        );
        let step = &measured.outcome;
        all_good &=
            step.refused.is_empty() && reached == step.accepted as u64 && token_fetches == 1;
    }
    all_good
}

/// Register `count` FCM devices; their push endpoints.
async fn register(server: &Server, count: usize) -> Vec<String> {
    let url = format!("{}/v1/fcm/bench/registration", server.endpoint_url);
    let mut endpoints = Vec::with_capacity(count);
    for i in 0..count {
        let body = json!({"token": format!("bench-device-{i}")}).to_string();
        let reply = autopush_tests::http::request(
            reqwest::Method::POST,
            &url,
            &[("content-type", "application/json")],
            Some(body.into_bytes()),
        )
        .await;
        let endpoint = reply.json["endpoint"]
            .as_str()
            .unwrap_or_else(|| panic!("registration failed: {} {}", reply.status, reply.text));
        endpoints.push(endpoint.to_owned());
    }
    endpoints
}
