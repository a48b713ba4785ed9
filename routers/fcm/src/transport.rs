//! FCM HTTP v1 transport: `POST {base_url}/v1/projects/{project_id}/messages:send`
//! with an OAuth2 bearer token, and how each answer maps onto what the
//! sender is told.
//!
//! One [`Project`] per Firebase project holds the HTTP client, the access
//! tokens, the in-flight cap and the retry policy, shared by every app (FCM
//! or GCM) that names the project. An [`App`] is one configured app id over
//! its project, with its own credential alarm.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use autopush_common::bridge::{
    AppLimit, AppLimits, Attempt, CredentialAlarm, InFlight, RetryPolicy,
    UPSTREAM_RETRY_AFTER_RANGE, upstream_too_many, with_retries,
};
use autopush_common::router::RouterError;
use hyper::StatusCode;
use serde_json::Value;

use crate::auth::{AccessTokens, Token};
use crate::client::{NoAnswer, Upstream};
use crate::message::AndroidMessage;
use crate::settings::AppSettings;

/// What a sender is told to wait when FCM is unavailable and said not how
/// long, or when the in-flight cap is reached.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(30);

/// One Firebase project: where to send, with which credentials.
pub struct Project {
    project_id: String,
    /// `messages:send` over HTTP/1.1 with a pool of keep-alive connections,
    /// one per request in flight, reused from push to push (HTTP/2 was
    /// measured and cost more per push; see BENCHMARKS.md).
    upstream: Upstream,
    tokens: AccessTokens,
    in_flight: InFlight,
    policy: RetryPolicy,
    identity: Identity,
}

/// What a project was built from: two apps naming its id with the same
/// `settings` share it, and a reload keeps it while its key is the same.
#[derive(PartialEq)]
struct Identity {
    project_id: String,
    /// base_url, deadline, max_in_flight.
    settings: (String, Duration, usize),
    /// The service-account JSON (a secret: never shown).
    key: String,
}

impl Identity {
    /// `app`'s project, checked, with its key read.
    fn of(app: &AppSettings) -> Result<Identity, String> {
        let base_url = app.base_url();
        if !(base_url.starts_with("https://") || base_url.starts_with("http://")) {
            return Err(format!("base_url must be an http(s) URL, got {base_url:?}"));
        }
        if app.project_id.is_empty()
            || !app
                .project_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(format!(
                "project_id must be a Firebase project id, got {:?}",
                app.project_id
            ));
        }
        Ok(Identity {
            project_id: app.project_id.clone(),
            settings: (base_url.to_owned(), app.timeout()?, app.max_in_flight()?),
            key: app.credential_json()?,
        })
    }
}

impl Project {
    fn new(identity: Identity) -> Result<Project, String> {
        let (base_url, deadline, max_in_flight) = identity.settings.clone();
        // No request timeout of the client's own: `with_retries` bounds each
        // send, every attempt and its token fetch included, by the deadline.
        // It is also the one retry policy. Built before the tokens: without
        // root certificates gcp_auth calls the key unusable, this says why.
        let url = format!(
            "{base_url}/v1/projects/{}/messages:send",
            identity.project_id
        );
        let upstream = Upstream::new(&url, deadline.min(Duration::from_secs(5)))
            .map_err(|e| format!("base_url: {e}"))?;
        let tokens = AccessTokens::new(identity.key.clone())?;
        Ok(Project {
            project_id: identity.project_id.clone(),
            upstream,
            tokens,
            in_flight: InFlight::new(max_in_flight, DEFAULT_RETRY_AFTER),
            policy: RetryPolicy {
                deadline,
                ..RetryPolicy::default()
            },
            identity,
        })
    }

    /// Send `message`, retrying what may succeed later, within the deadline.
    async fn send(
        &self,
        message: &AndroidMessage<'_>,
        alarm: &Alarm<'_>,
    ) -> Result<(), RouterError> {
        let _slot = self.in_flight.try_acquire()?;
        let body = Bytes::from(
            message
                .to_json()
                .map_err(|e| RouterError::Upstream(format!("cannot encode the message: {e}")))?,
        );
        with_retries(&self.policy, |_| self.attempt(&body, alarm)).await
    }

    async fn attempt(&self, body: &Bytes, alarm: &Alarm<'_>) -> Attempt<()> {
        let token = match self.tokens.get().await {
            Ok(token) => token,
            Err(error) => return alarm.token_failed(error),
        };
        let mut answer = self.post(&token, body).await;
        if matches!(&answer, Ok((StatusCode::UNAUTHORIZED, ..))) {
            // Revoked or expired early: one new token, one more try.
            answer = match self.tokens.refresh(&token).await {
                Ok(token) => self.post(&token, body).await,
                Err(error) => return alarm.token_failed(error),
            };
        }
        match answer {
            Ok((status, retry_after, reply)) => alarm.judge(status, retry_after, &reply),
            Err(error) => Attempt::Retry {
                error: RouterError::Connect(error.to_string()),
                retry_after: None,
            },
        }
    }

    async fn post(
        &self,
        token: &Token,
        body: &Bytes,
    ) -> Result<(StatusCode, Option<Duration>, Value), NoAnswer> {
        let answer = self.upstream.post(&token.header, body.clone()).await?;
        // Seconds (what FCM sends), at most the longest wait a sender is
        // ever told.
        let retry_after = answer
            .retry_after
            .map(|seconds| Duration::from_secs(seconds).min(UPSTREAM_RETRY_AFTER_RANGE.1));
        // Only a refusal's body says anything the sender is told.
        let reply = if answer.status.is_success() {
            Value::Null
        } else {
            serde_json::from_slice(&answer.body).unwrap_or(Value::Null)
        };
        Ok((answer.status, retry_after, reply))
    }
}

/// The projects built so far, so apps naming the same project share one;
/// after a reload, also those served before, kept while their settings and
/// key are the same (with their connections and access tokens).
#[derive(Default)]
pub struct Projects {
    built: Mutex<HashMap<String, Arc<Project>>>,
    before: Vec<Arc<Project>>,
}

impl Projects {
    /// Projects for a reload: those of the `served` apps are kept where
    /// an app names one with the same settings and key.
    pub fn after<'a>(served: impl IntoIterator<Item = &'a Arc<App>>) -> Projects {
        Projects {
            built: Mutex::default(),
            before: served.into_iter().map(|app| app.project.clone()).collect(),
        }
    }

    fn get(&self, app: &AppSettings) -> Result<Arc<Project>, String> {
        let identity = Identity::of(app)?;
        let mut built = self.built.lock().map_err(|e| e.to_string())?;
        match built.get(&app.project_id) {
            Some(existing) if existing.identity == identity => Ok(existing.clone()),
            // One project, one client and one token: a second key for it
            // would never be used, so it is refused rather than ignored.
            Some(existing) if existing.identity.settings == identity.settings => Err(format!(
                "project {} is named by another app with a different credential",
                app.project_id
            )),
            Some(_) => Err(format!(
                "project {} is named by another app with a different base_url, timeout or max_in_flight",
                app.project_id
            )),
            None => {
                let project = match self.before.iter().find(|p| p.identity == identity) {
                    Some(kept) => kept.clone(),
                    None => Arc::new(Project::new(identity)?),
                };
                built.insert(app.project_id.clone(), project.clone());
                Ok(project)
            }
        }
    }
}

/// A bridge's apps by id.
pub type Apps = HashMap<String, Arc<App>>;

/// One configured app id (FCM app name, GCM sender id) of a bridge.
pub struct App {
    bridge: &'static str,
    id: String,
    project: Arc<Project>,
    alarm: CredentialAlarm,
    /// Its own rate, whatever project it shares.
    limit: AppLimit,
}

impl App {
    /// The apps of one bridge (`fcm`, `gcm`) from its settings, each with
    /// its share of `limits`; an error names the app.
    pub fn configured(
        bridge: &'static str,
        apps: &BTreeMap<String, AppSettings>,
        projects: &Projects,
        limits: &AppLimits,
    ) -> Result<Apps, String> {
        apps.iter()
            .map(|(id, settings)| {
                let app = App::new(bridge, id, settings, projects, limits)
                    .map_err(|e| format!("{bridge} app {id:?}: {e}"))?;
                Ok((id.clone(), app))
            })
            .collect()
    }

    /// The apps of one bridge after a reload, from the settings `offered`
    /// for each (or why they were refused). An app whose settings are
    /// refused, or fail to build, stays as `served` had it, and its refusal
    /// is returned as (app id, reason). `projects` should come from
    /// [`Projects::after`], so that an unchanged app keeps its client.
    pub fn reloaded(
        bridge: &'static str,
        offered: &BTreeMap<String, Result<AppSettings, String>>,
        served: &Apps,
        projects: &Projects,
        limits: &AppLimits,
    ) -> (Apps, Vec<(String, String)>) {
        let mut apps = Apps::new();
        let mut refused = Vec::new();
        for (id, settings) in offered {
            let built = settings
                .as_ref()
                .map_err(String::clone)
                .and_then(|settings| App::new(bridge, id, settings, projects, limits));
            match (built, served.get(id)) {
                // Unchanged: the app as it was, its alarm included.
                (Ok(app), Some(before)) if Arc::ptr_eq(&app.project, &before.project) => {
                    apps.insert(id.clone(), before.clone());
                }
                (Ok(app), _) => {
                    apps.insert(id.clone(), app);
                }
                (Err(error), before) => {
                    if let Some(before) = before {
                        apps.insert(id.clone(), before.clone());
                    }
                    refused.push((id.clone(), error));
                }
            }
        }
        (apps, refused)
    }

    fn new(
        bridge: &'static str,
        id: &str,
        settings: &AppSettings,
        projects: &Projects,
        limits: &AppLimits,
    ) -> Result<Arc<App>, String> {
        Ok(Arc::new(App {
            bridge,
            id: id.to_owned(),
            project: projects.get(settings)?,
            alarm: CredentialAlarm::default(),
            limit: limits.app(bridge, id),
        }))
    }

    /// Deliver one `messages:send` body, if the app is within its rate.
    pub async fn send(&self, message: &AndroidMessage<'_>) -> Result<(), RouterError> {
        self.limit.check()?;
        let alarm = Alarm { app: self };
        let result = self.project.send(message, &alarm).await;
        if result.is_ok() {
            self.alarm.clear(self.bridge, &self.id);
        }
        result
    }
}

/// Reads FCM's answers for one app, raising its credential alarm.
struct Alarm<'a> {
    app: &'a App,
}

impl Alarm<'_> {
    fn raise(&self, detail: &str) {
        let detail = format!("project {}: {detail}", self.app.project.project_id);
        self.app.alarm.raise(self.app.bridge, &self.app.id, &detail);
    }

    fn token_failed(&self, error: RouterError) -> Attempt<()> {
        match error {
            RouterError::Authentication => {
                self.raise("the OAuth token endpoint refused the service-account key");
                Attempt::Fail(RouterError::Authentication)
            }
            other => Attempt::Retry {
                error: other,
                retry_after: None,
            },
        }
    }

    /// FCM's answer (see <https://firebase.google.com/docs/reference/fcm/rest/v1/ErrorCode>).
    fn judge(
        &self,
        status: StatusCode,
        retry_after: Option<Duration>,
        reply: &Value,
    ) -> Attempt<()> {
        let error = FcmError::read(reply);
        match status.as_u16() {
            200..=299 => Attempt::Done(()),
            // A quota (the project's, or a device's): retried within the
            // deadline, then 429 for the sender.
            code if code == 429 || error.status == "RESOURCE_EXHAUSTED" => Attempt::Retry {
                error: upstream_too_many(retry_after),
                retry_after,
            },
            404 => Attempt::Fail(RouterError::DeviceGone),
            _ if error.code == "UNREGISTERED" => Attempt::Fail(RouterError::DeviceGone),
            400 if error.names_the_token() => Attempt::Fail(RouterError::DeviceGone),
            400 => Attempt::Fail(RouterError::Refused(error.reason())),
            401 | 403 => {
                self.raise(&format!("FCM answered {status}: {}", error.reason()));
                Attempt::Fail(RouterError::Authentication)
            }
            500..=599 => Attempt::Retry {
                error: RouterError::Unavailable {
                    retry_after: retry_after.unwrap_or(DEFAULT_RETRY_AFTER),
                },
                retry_after,
            },
            _ => Attempt::Fail(RouterError::Upstream(format!(
                "FCM answered {status}: {}",
                error.reason()
            ))),
        }
    }
}

/// The parts of FCM's error body that decide what happens.
#[derive(Debug, Default)]
struct FcmError {
    /// `error.status`, e.g. `INVALID_ARGUMENT`.
    status: String,
    /// The FcmError detail's `errorCode`, e.g. `UNREGISTERED`.
    code: String,
    message: String,
    /// Fields named by a `google.rpc.BadRequest` detail.
    fields: Vec<String>,
}

impl FcmError {
    fn read(reply: &Value) -> FcmError {
        let error = &reply["error"];
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let details = error["details"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        FcmError {
            status: text(&error["status"]),
            code: details
                .iter()
                .find_map(|d| d["errorCode"].as_str())
                .unwrap_or_default()
                .to_owned(),
            message: text(&error["message"]),
            fields: details
                .iter()
                .filter_map(|d| d["fieldViolations"].as_array())
                .flatten()
                .filter_map(|v| v["field"].as_str().map(str::to_owned))
                .collect(),
        }
    }

    /// A 400 about the registration token: the device's registration is
    /// not (or no longer) valid.
    fn names_the_token(&self) -> bool {
        self.fields.iter().any(|f| f == "message.token")
            || self
                .message
                .to_ascii_lowercase()
                .contains("registration token")
    }

    fn reason(&self) -> String {
        match (self.status.as_str(), self.message.as_str()) {
            ("", "") => "no reason given".into(),
            (status, "") => status.into(),
            ("", message) => message.into(),
            (status, message) => format!("{status}: {message}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn app(project_id: &str, credential: String) -> AppSettings {
        AppSettings {
            project_id: project_id.into(),
            credential,
            base_url: Some("http://127.0.0.1:9".into()),
            timeout: None,
            max_in_flight: None,
        }
    }

    /// Apps naming one project share its client and token; one naming it
    /// with another key is refused at once, not silently served with the
    /// first app's.
    #[test]
    fn apps_of_one_project_share_it_and_a_second_key_is_refused() {
        let key = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../certs/fcm-service-account.json"
        ))
        .expect("certs/fcm-service-account.json");
        let mut other: Value = serde_json::from_str(&key).expect("the key's JSON");
        other["client_email"] = json!("other@try-bridges.iam.gserviceaccount.com");
        let projects = Projects::default();
        let first = projects
            .get(&app("shared", key.clone()))
            .expect("the first app");
        let second = projects.get(&app("shared", key)).expect("the second app");
        assert!(Arc::ptr_eq(&first, &second), "one project, one client");
        let refused = projects
            .get(&app("shared", other.to_string()))
            .err()
            .expect("a second key for the project is refused");
        assert!(refused.contains("different credential"), "{refused}");
    }

    #[test]
    fn fcm_errors_are_read() {
        let unregistered = json!({"error": {"code": 404, "status": "NOT_FOUND",
            "message": "Requested entity was not found.",
            "details": [{"@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError",
                         "errorCode": "UNREGISTERED"}]}});
        assert_eq!(FcmError::read(&unregistered).code, "UNREGISTERED");
        let bad_token = json!({"error": {"code": 400, "status": "INVALID_ARGUMENT",
            "message": "The registration token is not a valid FCM registration token",
            "details": [{"@type": "type.googleapis.com/google.rpc.BadRequest",
                         "fieldViolations": [{"field": "message.token",
                                              "description": "Invalid registration token"}]}]}});
        assert!(FcmError::read(&bad_token).names_the_token());
        let other = json!({"error": {"code": 400, "status": "INVALID_ARGUMENT",
            "message": "Invalid value at 'message.android.ttl'"}});
        let other = FcmError::read(&other);
        assert!(!other.names_the_token());
        assert_eq!(
            other.reason(),
            "INVALID_ARGUMENT: Invalid value at 'message.android.ttl'"
        );
        assert_eq!(FcmError::read(&Value::Null).reason(), "no reason given");
    }
}
