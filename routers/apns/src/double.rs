//! A stand-in for Apple (feature `test-double`): it records every request
//! the router sends, with its channel, and answers each device token with
//! the outcomes scripted for it, in order, then with 200. An optional delay
//! before every answer simulates Apple's latency. A device can be taken
//! offline: Apple then accepts every notification for it but keeps only the
//! last one, which is all the device gets when it comes back.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use autopush_common::bridge::AppLimits;
use tokio::sync::{Notify, watch};

use crate::ApnsRouter;
use crate::sender::{ApnsRequest, ApnsResponse, ApnsSender, TransportError};
use crate::settings::ApnsSettings;

/// How the double answers one request.
#[derive(Clone, Debug)]
pub enum Outcome {
    Answer(ApnsResponse),
    Fail(TransportError),
    /// Never answer (until the router gives up).
    Hang,
    /// Answer 200 once the test calls `notify_one` on it.
    HoldUntil(Arc<Notify>),
}

impl Outcome {
    /// A refusal with Apple's status and reason, e.g. `(410, "Unregistered")`.
    pub fn refused(status: u16, reason: &str) -> Outcome {
        Outcome::Answer(ApnsResponse::refused(status, reason))
    }
}

/// One request as Apple would have received it.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub channel: String,
    pub request: ApnsRequest,
}

#[derive(Default)]
pub struct ApnsDouble {
    delay: Duration,
    /// Count requests without keeping them (for load tests).
    count_only: bool,
    scripts: Mutex<HashMap<String, VecDeque<Outcome>>>,
    recorded: Mutex<Vec<Recorded>>,
    count: watch::Sender<usize>,
    /// Offline device tokens, with the one notification Apple keeps for each.
    offline: Mutex<HashMap<String, Option<Recorded>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ApnsDouble {
    pub fn new() -> Arc<ApnsDouble> {
        ApnsDouble::with_delay(Duration::ZERO)
    }

    /// Every answer comes `delay` after the request.
    pub fn with_delay(delay: Duration) -> Arc<ApnsDouble> {
        Arc::new(ApnsDouble {
            delay,
            ..ApnsDouble::default()
        })
    }

    /// A double for load: every request answered 200 after `delay`, counted
    /// but not kept.
    pub fn counting(delay: Duration) -> Arc<ApnsDouble> {
        Arc::new(ApnsDouble {
            delay,
            count_only: true,
            ..ApnsDouble::default()
        })
    }

    /// Take `device_token` offline: from now on only its last notification
    /// is kept for it, as Apple does.
    pub fn go_offline(&self, device_token: &str) {
        lock(&self.offline).insert(device_token.to_owned(), None);
    }

    /// Bring `device_token` back: what it receives now, the one
    /// notification kept while it was offline.
    pub fn come_online(&self, device_token: &str) -> Option<Recorded> {
        lock(&self.offline).remove(device_token).flatten()
    }

    /// How many requests have arrived.
    pub fn count(&self) -> usize {
        *self.count.borrow()
    }

    /// The next answers to requests for `device_token`.
    pub fn script(&self, device_token: &str, outcomes: impl IntoIterator<Item = Outcome>) {
        lock(&self.scripts)
            .entry(device_token.to_owned())
            .or_default()
            .extend(outcomes);
    }

    /// Every request so far, in arrival order.
    pub fn recorded(&self) -> Vec<Recorded> {
        lock(&self.recorded).clone()
    }

    /// The requests so far for one device token.
    pub fn requests_for(&self, device_token: &str) -> Vec<Recorded> {
        self.recorded()
            .into_iter()
            .filter(|r| r.request.device_token == device_token)
            .collect()
    }

    /// Wait until `n` requests in all have arrived.
    pub async fn wait_for(&self, n: usize) {
        let mut count = self.count.subscribe();
        let _ = count.wait_for(|seen| *seen >= n).await;
    }

    /// A sender for `channel` that records into this double.
    pub fn sender(self: &Arc<Self>, channel: &str) -> Arc<dyn ApnsSender> {
        Arc::new(ChannelSender {
            double: self.clone(),
            channel: channel.to_owned(),
        })
    }

    /// An [`ApnsRouter`] for `settings`, each channel within its rate in
    /// `limits`, with every channel sending here.
    pub fn router(
        self: &Arc<Self>,
        settings: &ApnsSettings,
        limits: &AppLimits,
    ) -> Result<ApnsRouter, String> {
        ApnsRouter::with_senders(settings, limits, |name, _| Ok(self.sender(name)))
    }

    async fn answer(
        &self,
        channel: &str,
        request: &ApnsRequest,
    ) -> Result<ApnsResponse, TransportError> {
        if !self.count_only {
            lock(&self.recorded).push(Recorded {
                channel: channel.to_owned(),
                request: request.clone(),
            });
        }
        if let Some(kept) = lock(&self.offline).get_mut(&request.device_token) {
            *kept = Some(Recorded {
                channel: channel.to_owned(),
                request: request.clone(),
            });
        }
        self.count.send_modify(|n| *n += 1);
        let outcome = lock(&self.scripts)
            .get_mut(&request.device_token)
            .and_then(VecDeque::pop_front);
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        match outcome {
            None => Ok(ApnsResponse::accepted()),
            Some(Outcome::Answer(response)) => Ok(response),
            Some(Outcome::Fail(error)) => Err(error),
            Some(Outcome::Hang) => std::future::pending().await,
            Some(Outcome::HoldUntil(release)) => {
                release.notified().await;
                Ok(ApnsResponse::accepted())
            }
        }
    }
}

struct ChannelSender {
    double: Arc<ApnsDouble>,
    channel: String,
}

#[async_trait]
impl ApnsSender for ChannelSender {
    async fn send(&self, request: &ApnsRequest) -> Result<ApnsResponse, TransportError> {
        self.double.answer(&self.channel, request).await
    }
}
