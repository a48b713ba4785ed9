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
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::json;

use crate::app_server::{AppServer, Bodies};
use crate::open_loop::{self, Connections, Load, cpu_percent, micros_per_push};
use crate::server::{Server, cpu_ticks};
use crate::stand_in::StandIn;
use crate::stats::{offered_cell, rate, refused_cell};

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
    let sender = Arc::new(AppServer::new(&server.endpoint_url));
    let bodies = Arc::new(Bodies::new(
        &URL_SAFE_NO_PAD
            .decode(sender.public_key())
            .unwrap_or_default(),
    ));
    let endpoints = Arc::new(register(&server, options.devices).await);
    let load = Load {
        endpoint_url: server.endpoint_url.clone(),
        sender,
        bodies,
        endpoints,
        connections: options.connections,
        seconds: options.seconds,
    };
    // The first push fetches the access token; the rates measure what follows.
    open_loop::warm_up(&load).await;
    let mut connections = Connections::open(&load).await;
    let me = std::process::id();
    let mut all_good = true;
    for &offered in &options.rates {
        let before = google.received().await;
        let cpu_before = (server.cpu_ticks(), google.cpu_ticks(), cpu_ticks(me));
        let (step, open) = open_loop::push(&load, connections, offered).await;
        connections = open;
        let cpu = (
            server.cpu_ticks().saturating_sub(cpu_before.0),
            google.cpu_ticks().saturating_sub(cpu_before.1),
            cpu_ticks(me).saturating_sub(cpu_before.2),
        );
        let stats = google.stats().await;
        let reached = stats["received"].as_u64().unwrap_or(0) - before;
        let token_fetches = stats["token_fetches"].as_u64().unwrap_or(0);
        let mut latencies = step.latencies;
        let (offered, refused) = (offered_cell(offered), refused_cell(&step.refused));
        println!(
            "| {} | {offered} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {refused} | {reached} | {token_fetches} |",
            delay.as_millis(),
            rate(step.accepted, step.elapsed),
            latencies.percentile_ms(50.0),
            latencies.percentile_ms(99.0),
            latencies.percentile_ms(100.0),
            step.most_in_flight,
            cpu_percent(cpu.0, step.elapsed),
            micros_per_push(cpu.0, step.accepted),
            cpu_percent(cpu.1, step.elapsed),
            cpu_percent(cpu.2, step.elapsed),
        );
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
