//! `wake`: the client registers (or removes) its wake route, the bridge app
//! and device token through which a content-free wake-up reaches it while
//! it is away; and close code 4774, a client leaving that expects one.

use autopush_common::ids::uaid_tag;
use autopush_common::router::RouterError;
use autopush_common::{RouterType, WakeRoute};
use tracing::info;

use super::{Flow, Session};
use crate::protocol::ServerMessage;

/// The close code of a client that will not reconnect by itself and
/// expects the server to wake it (Mozilla's protocol, from its UDP
/// wake-ups).
pub(super) const EXPECTS_WAKE_UP: u16 = 4774;

impl Session {
    pub(super) async fn wake(
        &mut self,
        router: Option<&str>,
        app_id: Option<&str>,
        token: Option<&str>,
    ) -> Flow {
        let refuse = |status: u16, reason: String| ServerMessage::Wake {
            status,
            reason: Some(reason),
        };
        let route = match router {
            None => None,
            Some(router) => match self.wake_route(router, app_id, token) {
                Ok(route) => Some(route),
                Err((status, reason)) => return self.send(&refuse(status, reason)).await,
            },
        };
        match self
            .ctx
            .storage
            .set_wake_route(&self.uaid, route.as_ref())
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                let reason = "this user agent's registration was removed; say hello again";
                return self.send(&refuse(410, reason.into())).await;
            }
            Err(e) => {
                let reason = self.storage_failed("wake", &e).to_owned();
                return self.send(&refuse(503, reason)).await;
            }
        }
        self.send(&ServerMessage::Wake {
            status: 200,
            reason: None,
        })
        .await
    }

    /// The route a client asks for, checked by its bridge: an error status
    /// and reason otherwise.
    fn wake_route(
        &self,
        router: &str,
        app_id: Option<&str>,
        token: Option<&str>,
    ) -> Result<WakeRoute, (u16, String)> {
        let router_type = match router {
            "fcm" => RouterType::Fcm,
            "apns" => RouterType::Apns,
            other => {
                return Err((
                    400,
                    format!("router must be \"fcm\", \"apns\" or null, not {other:?}"),
                ));
            }
        };
        let (Some(app_id), Some(token)) = (app_id, token) else {
            return Err((400, "app_id and token are required".into()));
        };
        let checked = match self.ctx.wake_bridges.get(router_type) {
            Some(bridge) => bridge.check_wake_route(app_id, token),
            None => Err(RouterError::UnknownApp(app_id.to_owned())),
        };
        match checked {
            Ok(()) => Ok(WakeRoute {
                router: router_type,
                app_id: app_id.to_owned(),
                token: token.to_owned(),
            }),
            Err(RouterError::UnknownApp(_)) => Err((
                404,
                format!("no {router} app {app_id:?} is configured on this server"),
            )),
            Err(RouterError::InvalidRegistration(reason)) => Err((400, reason)),
            Err(e) => Err((400, e.to_string())),
        }
    }

    /// The client closed with [`EXPECTS_WAKE_UP`]: nothing changes (a
    /// client without a wake route simply waits for its next connection),
    /// but the log says what it expects.
    pub(super) fn left_to_be_woken(&self) {
        info!(uaid = %uaid_tag(&self.uaid), "client left expecting a wake-up (close code 4774)");
    }
}
