//! The APNs bridge: delivers Web Push messages to iOS apps through Apple
//! Push Notification service.
//!
//! * [`settings`]: one channel per release channel (`app_id`), with its
//!   topic, environment and credentials.
//! * [`payload`]: what a registration stores and what Apple is sent.
//! * [`sender`]: the boundary with Apple, [`client`] its a2 implementation.
//! * [`ApnsRouter`]: the [`Router`]: per-channel clients, rate, deadline,
//!   retries, in-flight cap and the reading of Apple's answers.

pub mod client;
#[cfg(any(test, feature = "test-double"))]
pub mod double;
pub mod payload;
pub mod sender;
pub mod settings;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use autopush_common::bridge::{
    AppLimit, AppLimits, Attempt, CredentialAlarm, InFlight, RetryPolicy, upstream_too_many,
    with_retries,
};
use autopush_common::router::{Delivery, Router, RouterDataInput, RouterError, WakeUp};
use autopush_common::{ApiResult, Notification, User};
use tracing::warn;

use crate::client::A2Sender;
use crate::payload::RouterData;
use crate::sender::{ApnsRequest, ApnsResponse, ApnsSender, TransportError};
use crate::settings::{ApnsChannel, ApnsSettings};

/// `Retry-After` for a sender refused because the channel's in-flight cap
/// is reached.
pub const BUSY_RETRY_AFTER: Duration = Duration::from_secs(5);

/// `Retry-After` for a sender whose push Apple kept refusing with 503.
pub const UPSTREAM_RETRY_AFTER: Duration = Duration::from_secs(30);

/// Apple's answers that mean the device token is dead for this app.
const GONE: [&str; 3] = ["BadDeviceToken", "Unregistered", "DeviceTokenNotForTopic"];

/// Apple's answers that mean our credentials are refused.
const REFUSED_CREDENTIALS: [&str; 5] = [
    "ExpiredProviderToken",
    "InvalidProviderToken",
    "MissingProviderToken",
    "BadCertificate",
    "BadCertificateEnvironment",
];

/// One release channel: its client and its share of the node.
struct Channel {
    /// What it was built from: a reload keeps it while these are the same.
    settings: ApnsChannel,
    /// Its key material as read then (`None`: not readable, a test double's).
    material: Option<Vec<Vec<u8>>>,
    name: String,
    topic: String,
    sender: Arc<dyn ApnsSender>,
    retry: RetryPolicy,
    in_flight: InFlight,
    alarm: CredentialAlarm,
    limit: AppLimit,
}

#[derive(Default)]
pub struct ApnsRouter {
    channels: BTreeMap<String, Arc<Channel>>,
}

impl settings::ApnsSection {
    /// The APNs bridge: a router with an a2 client per channel, each within
    /// its rate in `limits` (none when no channel is configured).
    pub fn router(&self, limits: &AppLimits) -> Result<ApnsRouter, String> {
        ApnsRouter::new(&self.settings(), limits)
    }
}

impl ApnsRouter {
    /// A router with an a2 client per channel, each channel within its rate
    /// in `limits`. Bad key material is an error naming the channel and the
    /// field.
    pub fn new(settings: &ApnsSettings, limits: &AppLimits) -> Result<ApnsRouter, String> {
        ApnsRouter::with_senders(settings, limits, |_, channel| {
            Ok(Arc::new(A2Sender::new(channel)?) as Arc<dyn ApnsSender>)
        })
    }

    /// A router whose channels send through what `sender` makes for each
    /// (name, settings): the a2 client, or a test double.
    pub fn with_senders<F>(
        settings: &ApnsSettings,
        limits: &AppLimits,
        mut sender: F,
    ) -> Result<ApnsRouter, String>
    where
        F: FnMut(&str, &ApnsChannel) -> Result<Arc<dyn ApnsSender>, String>,
    {
        let mut channels = BTreeMap::new();
        for (name, channel) in &settings.channels {
            let sender =
                sender(name, channel).map_err(|e| format!("apns channel {name:?}: {e}"))?;
            let retry = RetryPolicy {
                deadline: channel.timeout(),
                ..RetryPolicy::default()
            };
            channels.insert(
                name.clone(),
                Arc::new(Channel {
                    settings: channel.clone(),
                    material: channel.material().ok(),
                    name: name.clone(),
                    topic: channel.topic.clone(),
                    sender,
                    retry,
                    in_flight: InFlight::new(channel.max_in_flight, BUSY_RETRY_AFTER),
                    alarm: CredentialAlarm::default(),
                    limit: limits.app("apns", name),
                }),
            );
        }
        Ok(ApnsRouter { channels })
    }

    /// This router's channels after a reload, from the settings `offered`
    /// for each (or why they were refused), and the refusals by channel
    /// name. A channel whose settings and key material are unchanged keeps
    /// its client; one whose new settings are refused, or fail to build,
    /// stays as it was.
    pub fn reloaded(
        &self,
        offered: &BTreeMap<String, Result<ApnsChannel, String>>,
        limits: &AppLimits,
    ) -> (ApnsRouter, Vec<(String, String)>) {
        let mut channels = BTreeMap::new();
        let mut refused = Vec::new();
        for (name, settings) in offered {
            let before = self.channels.get(name);
            let built = settings
                .as_ref()
                .map_err(String::clone)
                .and_then(|settings| {
                    let material = settings.material()?;
                    match before {
                        Some(before)
                            if before.settings == *settings
                                && before.material.as_ref() == Some(&material) =>
                        {
                            Ok(before.clone())
                        }
                        _ => {
                            let one = ApnsSettings {
                                channels: BTreeMap::from([(name.clone(), settings.clone())]),
                            };
                            let mut router = ApnsRouter::new(&one, limits)?;
                            router
                                .channels
                                .remove(name)
                                .ok_or_else(|| format!("apns channel {name:?} was not built"))
                        }
                    }
                });
            match built {
                Ok(channel) => {
                    channels.insert(name.clone(), channel);
                }
                Err(error) => {
                    if let Some(before) = before {
                        channels.insert(name.clone(), before.clone());
                    }
                    refused.push((name.clone(), error));
                }
            }
        }
        (ApnsRouter { channels }, refused)
    }

    /// How many channels are served.
    pub fn len(&self) -> usize {
        self.channels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.channels.is_empty()
    }

    /// The names of what is served, in no order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.channels.keys().map(String::as_str)
    }
}

#[async_trait]
impl Router for ApnsRouter {
    fn register(
        &self,
        input: &RouterDataInput,
        app_id: &str,
    ) -> Result<serde_json::Value, RouterError> {
        if !self.channels.contains_key(app_id) {
            return Err(RouterError::UnknownApp(app_id.to_owned()));
        }
        payload::register(input, app_id)
    }

    async fn route_notification(
        &self,
        notification: Notification,
        user: &User,
    ) -> ApiResult<Delivery> {
        let data = RouterData::of(user)?;
        // A channel this server no longer serves is our fault, not the
        // device's: 502, and the registration is kept.
        let channel = self.channels.get(data.channel).ok_or_else(|| {
            tracing::error!(
                bridge = "apns",
                app_id = data.channel,
                "a registration names a channel this server has no settings for"
            );
            RouterError::Upstream(format!(
                "no apns channel {:?} is configured on this server",
                data.channel
            ))
        })?;
        let request = payload::request(&notification, &data, &channel.topic)?;
        channel.send(&request).await?;
        Ok(Delivery::Direct)
    }

    fn check_wake_route(&self, app_id: &str, token: &str) -> Result<(), RouterError> {
        if !self.channels.contains_key(app_id) {
            return Err(RouterError::UnknownApp(app_id.to_owned()));
        }
        payload::check_wake_token(token)
    }

    async fn wake(&self, app_id: &str, token: &str, wake: &WakeUp) -> Result<(), RouterError> {
        let channel = self
            .channels
            .get(app_id)
            .ok_or_else(|| RouterError::UnknownApp(app_id.to_owned()))?;
        channel
            .send(&payload::wake_request(token, wake, &channel.topic))
            .await
    }
}

impl Channel {
    /// Send `request` within the channel's rate, in-flight cap and deadline.
    async fn send(&self, request: &ApnsRequest) -> Result<(), RouterError> {
        self.limit.check()?;
        let _slot = self.in_flight.try_acquire()?;
        with_retries(&self.retry, |_| self.attempt(request)).await
    }

    async fn attempt(&self, request: &ApnsRequest) -> Attempt<()> {
        match self.sender.send(request).await {
            Ok(response) if response.status == 200 => {
                self.alarm.clear("apns", &self.name);
                Attempt::Done(())
            }
            Ok(response) => self.refused(response),
            Err(TransportError::Connect(e)) => Attempt::Retry {
                error: RouterError::Connect(format!("APNs: {e}")),
                retry_after: None,
            },
            Err(TransportError::Timeout) => Attempt::Fail(RouterError::Timeout),
            Err(TransportError::Request(e)) => {
                warn!(channel = %self.name, error = %e, "APNs request could not be sent");
                Attempt::Fail(RouterError::Upstream(format!("APNs request failed: {e}")))
            }
        }
    }

    /// Read a refusal: a dead token, our credentials, too many requests (for
    /// the device: not retried), a busy or failing Apple (retried), or
    /// anything else (logged).
    fn refused(&self, response: ApnsResponse) -> Attempt<()> {
        let status = response.status;
        let reason = response.reason.as_deref().unwrap_or("");
        if status == 410 || GONE.contains(&reason) {
            return Attempt::Fail(RouterError::DeviceGone);
        }
        if status == 403 || REFUSED_CREDENTIALS.contains(&reason) {
            self.alarm
                .raise("apns", &self.name, &format!("{status} {reason}"));
            return Attempt::Fail(RouterError::Authentication);
        }
        if status == 429 || reason == "TooManyRequests" {
            // Apple gives no Retry-After; trying again at once would only
            // prolong it.
            return Attempt::Fail(upstream_too_many(None));
        }
        let error = match (status, reason) {
            (503, _) | (_, "ServiceUnavailable" | "Shutdown") => RouterError::Unavailable {
                retry_after: UPSTREAM_RETRY_AFTER,
            },
            (500, _) | (_, "InternalServerError") => {
                RouterError::Upstream(format!("APNs answered {status} {reason}"))
            }
            _ => {
                warn!(channel = %self.name, status, reason, "APNs refused the notification");
                return Attempt::Fail(RouterError::Upstream(format!(
                    "APNs refused the notification: {status} {reason}"
                )));
            }
        };
        Attempt::Retry {
            error,
            retry_after: None,
        }
    }
}
