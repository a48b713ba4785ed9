//! The webpush router: deliver to the connection node the user is on, or
//! store the message and tell a node that may have just picked the user up.
//!
//! Follows the seeds' "Push Characteristics": a node that answers "not here"
//! (404, and only that) gets the user's `node_id` cleared (conditionally on
//! `connected_at`), and after storing, the user record is read again because
//! the client may have reconnected and already checked storage in between.
//! Any other answer, or none in time, means the node is busy (overloaded,
//! paused, its router key or clock not yet agreeing with ours): the message
//! is stored and the node told to look (asked again until it answers, see
//! [`NodeClient::notify`]), and `node_id` stays, so its client keeps
//! receiving once the node recovers.
//!
//! With durable direct delivery on, a message is written to storage before
//! it is handed to the connection node (and before the sender hears 201), and
//! the session deletes it when the client acks: a node killed before the ack
//! loses nothing. On a store billed per write (DynamoDB, Bigtable) the
//! connection node holds that copy back instead, writing it only if the
//! client has not acked within a grace ([`held`]). Off, a direct message
//! lives in the node's memory until the
//! ack, and is written to storage only if the session ends without one.
//!
//! A message less urgent than the user agent's minimum (RFC 8030 §5.3,
//! kept on its record) is held: stored without waking the client, and
//! sent once the client lowers its minimum.
//!
//! Every node call names the router API version it speaks, and so does
//! every answer of ours ([`protocol`]). What a node says about a durable
//! copy is trusted only when the answer is ours. autopush-rs's node (on a
//! shared Bigtable table during a migration) never deletes a durable copy:
//! its direct acks do not touch storage. When a node the migration declares
//! as autopush-rs's takes a message, the copy is removed here, as
//! autopush-rs's own endpoint never writes one. Any other answer (our
//! nodes of protocol 1 among them) leaves the copy in place, or has it
//! written here: a duplicate, never a loss.

pub mod held;
pub mod node_client;
pub mod node_journal;
pub mod protocol;
pub mod urgency;
pub mod wake;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use autopush_common::node::{LocalNode, PushOutcome};
use autopush_common::receipt::MessageState;
use autopush_common::router::{Delivery, Router, RouterDataInput, RouterError};
use autopush_common::{ApiResult, Notification, User};
use autopush_storage::{CopyEnd, Storage};
use http::{Method, StatusCode};
use tracing::{debug, warn};
use uuid::Uuid;

pub use held::{CopyFate, DURABLE_COPY, HOLD, push_holding_copy};
pub use node_client::{NodeCallError, NodeClient};
pub use node_journal::NodeJournal;
pub use protocol::{Answerer, ROUTER_API, SETTLES_DURABLE_COPY};
pub use wake::{WakeSettings, Waker};

use autopush_common::router::WakeUp;

/// What a node answered to a push that asked it to hold the copy.
struct HeldAnswer {
    outcome: PushOutcome,
    answerer: Answerer,
    /// What became of the copy, if the node held it (and is ours).
    fate: Option<CopyFate>,
}

/// The outcome a node's answer to `PUT /push` means: only a 404 is "not
/// connected"; any other failure is "busy".
fn outcome_of(node_id: &str, status: u16) -> PushOutcome {
    match status {
        200 => PushOutcome::Delivered,
        404 => PushOutcome::NotConnected,
        503 => PushOutcome::Busy,
        status => {
            warn!(
                node_id,
                status, "connection node refused a push; storing it"
            );
            PushOutcome::Busy
        }
    }
}

/// A node took the message for its client.
struct Taken {
    /// The message, handed back when that node is autopush-rs's, which
    /// does not delete a durable copy at the client's ack: the copy is
    /// then ours to remove.
    unsettled: Option<Notification>,
}

/// Whether a message delivered directly has a copy in storage until its
/// ack (and so a receipt that follows it): with durable direct delivery on,
/// every message whose TTL is not 0 (TTL 0 means now or never: it is not
/// worth a write).
pub fn stores_direct(durable_direct: bool, ttl: u64) -> bool {
    durable_direct && ttl > 0
}

/// What a connection node says of a copy it kept, for `GET /m/…`.
pub enum KeptReceipt {
    /// The copy's state, and when it took it.
    Known(MessageState, u64),
    /// The node no longer knows it: moved to storage, or its receipt's
    /// retention is over.
    Unknown,
    /// No answer: the node is down, busy, or keeps no journal.
    Unanswered,
}

pub struct WebPushRouter {
    storage: Arc<dyn Storage>,
    /// Other connection nodes, over their signed router API.
    nodes: NodeClient,
    /// The connection node in this process, reached without HTTP.
    local: Option<Arc<dyn LocalNode>>,
    /// That node's own journal of the copies it holds, if it keeps one.
    journal: Option<Arc<NodeJournal>>,
    /// Store every message before delivering it directly.
    durable_direct: bool,
    /// Wakes user agents that are away and registered a wake route.
    waker: Option<Arc<Waker>>,
    /// The addresses of autopush-rs's connection nodes, during a declared
    /// migration (`--autopush-rs-nodes`).
    autopush_rs_nodes: Vec<ipnet::IpNet>,
    /// Whether a node that does not say what it is was logged.
    unknown_logged: AtomicBool,
    /// Most messages held below a user agent's minimum urgency.
    hold_limit: usize,
}

impl WebPushRouter {
    pub fn new(
        storage: Arc<dyn Storage>,
        local: Option<Arc<dyn LocalNode>>,
        durable_direct: bool,
        nodes: NodeClient,
    ) -> Self {
        WebPushRouter {
            storage,
            nodes,
            local,
            journal: None,
            durable_direct,
            waker: None,
            autopush_rs_nodes: Vec::new(),
            unknown_logged: AtomicBool::new(false),
            hold_limit: 100,
        }
    }

    /// Take silent answers from `nodes` (addresses or networks) as
    /// autopush-rs's connection nodes', during a migration.
    pub fn with_autopush_rs_nodes(mut self, nodes: Vec<ipnet::IpNet>) -> Self {
        self.autopush_rs_nodes = nodes;
        self
    }

    /// Who sent `response`; the first node that does not say is logged.
    fn answerer(&self, node_id: &str, response: &reqwest::Response) -> Answerer {
        let peer = response.remote_addr().map(|addr| addr.ip());
        let answerer = protocol::answerer(response.headers(), peer, &self.autopush_rs_nodes);
        if answerer == Answerer::Unknown && !self.unknown_logged.swap(true, Ordering::Relaxed) {
            warn!(
                node_id,
                "a connection node answered without naming its router API version: the \
                 durable copies of pushes it takes are kept (a message may come twice); \
                 upgrade it, or name autopush-rs's nodes in --autopush-rs-nodes"
            );
        }
        answerer
    }

    /// Hold at most `limit` messages below a user agent's minimum urgency
    /// (see [`urgency`]); 100 unless set.
    pub fn with_hold_limit(mut self, limit: usize) -> Self {
        self.hold_limit = limit;
        self
    }

    /// The connection node in this process keeps the copies it holds in
    /// `journal` ([`node_journal`]).
    pub fn with_journal(mut self, journal: Option<Arc<NodeJournal>>) -> Self {
        self.journal = journal;
        self
    }

    /// Send wake-ups to user agents that are away, with `waker`.
    pub fn with_waker(mut self, waker: Arc<Waker>) -> Self {
        self.waker = Some(waker);
        self
    }

    fn local_for(&self, node_id: &str) -> Option<&Arc<dyn LocalNode>> {
        self.local
            .as_ref()
            .filter(|local| local.node_id() == node_id)
    }

    /// `PUT {node_id}/push/{uaid}`, or the in-process equivalent; with
    /// the message back if autopush-rs's node answered (see [`Taken`]).
    async fn push_to_node(
        &self,
        node_id: &str,
        uaid: &Uuid,
        notification: Notification,
    ) -> (PushOutcome, Option<Notification>) {
        if let Some(local) = self.local_for(node_id) {
            return (local.push(uaid, notification), None);
        }
        let path = format!("/push/{}", uaid.simple());
        let body = notification.to_json().unwrap_or_default();
        match self.nodes.call(Method::PUT, node_id, &path, body).await {
            Ok(response) => {
                let autopush_rs = self.answerer(node_id, &response) == Answerer::AutopushRs;
                let outcome = outcome_of(node_id, response.status().as_u16());
                (outcome, autopush_rs.then_some(notification))
            }
            Err(e) => {
                // Slow, paused or restarting: its clients may still be there.
                warn!(node_id, error = %e, "connection node did not answer; storing the push");
                (PushOutcome::Busy, None)
            }
        }
    }

    /// `PUT {node_id}/push/{uaid}` asking the node to hold the durable
    /// copy (see [`held`]), or the in-process equivalent.
    async fn push_holding_copy(
        &self,
        node_id: &str,
        uaid: &Uuid,
        notification: Notification,
    ) -> HeldAnswer {
        if let Some(local) = self.local_for(node_id) {
            // The endpoint in this process seals an ack within the grace.
            let (outcome, fate) = push_holding_copy(
                local.clone(),
                self.storage.clone(),
                self.journal.clone(),
                *uaid,
                notification,
                true,
            )
            .await;
            return HeldAnswer {
                outcome,
                answerer: Answerer::Ours,
                fate,
            };
        }
        let path = format!("/push/{}", uaid.simple());
        let body = notification.to_json().unwrap_or_default();
        let hold = Some((DURABLE_COPY, HOLD));
        match self
            .nodes
            .call_with(Method::PUT, node_id, &path, body, hold)
            .await
        {
            Ok(response) => {
                let answerer = self.answerer(node_id, &response);
                let fate = match answerer {
                    Answerer::Ours => response
                        .headers()
                        .get(DURABLE_COPY)
                        .and_then(|v| CopyFate::parse(v.as_bytes())),
                    Answerer::AutopushRs | Answerer::Unknown => None,
                };
                HeldAnswer {
                    outcome: outcome_of(node_id, response.status().as_u16()),
                    answerer,
                    fate,
                }
            }
            Err(e) => {
                // Slow, paused, restarting or killed: it may have delivered
                // the message, and may not have written the copy.
                warn!(node_id, error = %e, "connection node did not answer; storing the push");
                HeldAnswer {
                    outcome: PushOutcome::Busy,
                    answerer: Answerer::Unknown,
                    fate: None,
                }
            }
        }
    }

    /// Deliver a durable message to the node `user` is on, that node
    /// holding its copy back: no write if the client acks within the grace.
    async fn deliver_held(
        &self,
        node_id: &str,
        user: &User,
        notification: Notification,
    ) -> ApiResult<Delivery> {
        let uaid = user.uaid;
        let answer = self
            .push_holding_copy(node_id, &uaid, notification.clone())
            .await;
        match (answer.outcome, answer.fate) {
            (PushOutcome::Delivered, Some(CopyFate::Acked)) => Ok(Delivery::Acked),
            // The node keeps the copy, and moves it to storage (telling
            // whichever node has the client then) if no ack comes.
            (PushOutcome::Delivered, Some(CopyFate::Kept)) => Ok(Delivery::Kept),
            (PushOutcome::Delivered, Some(CopyFate::Written)) => {
                // Unacked within the grace: the client may have left for
                // another node, whose storage check came before the write.
                self.nudge_if_moved(node_id, user).await?;
                Ok(Delivery::Direct)
            }
            // autopush-rs's node: it keeps the message until the ack, and
            // stores it itself if the client leaves without one, as its
            // own endpoint (which writes no copy) expects.
            (PushOutcome::Delivered, None) if answer.answerer == Answerer::AutopushRs => {
                Ok(Delivery::Direct)
            }
            (PushOutcome::Delivered, None) => {
                // A node of ours that could not write the copy, or one
                // that does not hold copies or does not say what it is:
                // the copy is ours to write. Written again after an ack, it
                // is delivered again at the next hello: a duplicate, never
                // a loss.
                self.storage.save_direct(&uaid, notification).await?;
                self.nudge_if_moved(node_id, user).await?;
                Ok(Delivery::Direct)
            }
            (PushOutcome::NotConnected, _) => {
                self.storage
                    .remove_node_id(&uaid, node_id, user.connected_at)
                    .await?;
                let wake = wake::wake_up_for(&notification);
                self.storage.save_direct(&uaid, notification).await?;
                self.stored(&uaid, wake).await
            }
            (PushOutcome::Busy, _) => {
                // Written again if the node wrote it too: the same version.
                let wake = wake::wake_up_for(&notification);
                self.storage.save_direct(&uaid, notification).await?;
                self.stored(&uaid, wake).await
            }
        }
    }

    /// A copy was written after the push: if the user's record names
    /// another connection than the one pushed to, that connection's
    /// storage check may have missed it, so nudge its node.
    async fn nudge_if_moved(&self, node_id: &str, user: &User) -> ApiResult<()> {
        let now = self.storage.get_user(&user.uaid).await?;
        if let Some(now) = now
            && let Some(now_on) = &now.node_id
            && (now_on != node_id || now.connected_at != user.connected_at)
        {
            self.notify_node(now_on, &user.uaid).await;
        }
        Ok(())
    }

    /// Push to the node the user is on; whether the node took the message.
    /// One that says the user is not there has the user's `node_id`
    /// cleared (conditionally on `connected_at`).
    async fn pushed(
        &self,
        node_id: &str,
        user: &User,
        notification: Notification,
    ) -> ApiResult<Option<Taken>> {
        match self.push_to_node(node_id, &user.uaid, notification).await {
            (PushOutcome::Delivered, unsettled) => return Ok(Some(Taken { unsettled })),
            (PushOutcome::Busy, _) => debug!("client busy; storing"),
            (PushOutcome::NotConnected, _) => {
                self.storage
                    .remove_node_id(&user.uaid, node_id, user.connected_at)
                    .await?;
            }
        }
        Ok(None)
    }

    /// Deliver a message that has no copy in storage: it is kept back, to
    /// be saved if the push does not reach the client (unless its TTL is 0).
    async fn deliver_kept(&self, notification: Notification, user: &User) -> ApiResult<Delivery> {
        if let Some(node_id) = &user.node_id
            && self
                .pushed(node_id, user, notification.clone())
                .await?
                .is_some()
        {
            return Ok(Delivery::Direct);
        }
        if notification.ttl == 0 {
            return Ok(Delivery::Dropped);
        }
        let wake = wake::wake_up_for(&notification);
        self.storage
            .save_messages(&user.uaid, vec![notification])
            .await?;
        self.stored(&user.uaid, wake).await
    }

    /// Keep a message below the user agent's minimum urgency in storage,
    /// without waking its client (TTL 0: dropped). The client may have
    /// lowered its minimum (and checked storage) since we read its record:
    /// look again, and if the message is now accepted, nudge its node.
    async fn hold(&self, notification: Notification, user: &User) -> ApiResult<Delivery> {
        if notification.ttl == 0 {
            return Ok(Delivery::Dropped);
        }
        let uaid = user.uaid;
        urgency::make_room(self.storage.as_ref(), user, &notification, self.hold_limit).await?;
        self.storage
            .save_messages(&uaid, vec![notification.clone()])
            .await?;
        if let Some(now) = self.storage.get_user(&uaid).await?
            && !now.holds(&notification)
            && let Some(node_id) = &now.node_id
        {
            self.notify_node(node_id, &uaid).await;
        }
        Ok(Delivery::Stored)
    }

    /// The message is in storage: the client may have connected (and
    /// checked storage) since we read its record, so look again and nudge
    /// whichever node has it now; with none, wake it if it asked to be.
    async fn stored(&self, uaid: &Uuid, wake: WakeUp) -> ApiResult<Delivery> {
        let Some(user) = self.storage.get_user(uaid).await? else {
            return Ok(Delivery::Stored);
        };
        match (&user.node_id, &self.waker) {
            (Some(node_id), _) => self.notify_node(node_id, uaid).await,
            (None, Some(waker)) => waker.after_stored(&user, wake),
            (None, None) => {}
        }
        Ok(Delivery::Stored)
    }

    /// The receipt of a message whose copy `node_id` kept (see
    /// [`node_journal`]), as that node knows it: `GET
    /// {node_id}/receipt/{uaid}/{sort_key}/{tag}`, or this process's own
    /// journal.
    pub async fn kept_receipt(
        &self,
        node_id: &str,
        uaid: &Uuid,
        sort_key: &str,
        tag: [u8; 8],
    ) -> KeptReceipt {
        if self.local_for(node_id).is_some() {
            let Some(journal) = &self.journal else {
                return KeptReceipt::Unanswered;
            };
            return match journal.receipt(uaid, sort_key, tag).await {
                Ok(Some((state, at))) => KeptReceipt::Known(state, at),
                Ok(None) => KeptReceipt::Unknown,
                Err(_) => KeptReceipt::Unanswered,
            };
        }
        let tag = autopush_common::ids::hex(&tag);
        let path = format!("/receipt/{}/{sort_key}/{tag}", uaid.simple());
        let response = match self
            .nodes
            .call(Method::GET, node_id, &path, Vec::new())
            .await
        {
            Ok(response) if response.status().is_success() => response,
            Ok(response) if response.status() == StatusCode::NOT_FOUND => {
                return KeptReceipt::Unknown;
            }
            Ok(_) => return KeptReceipt::Unanswered,
            Err(e) => {
                warn!(node_id, error = %e, "could not ask a connection node for a receipt");
                return KeptReceipt::Unanswered;
            }
        };
        let known = async {
            let receipt: serde_json::Value = response.json().await.ok()?;
            let state = MessageState::parse(receipt["state"].as_str()?)?;
            Some(KeptReceipt::Known(state, receipt["updated"].as_u64()?))
        };
        known.await.unwrap_or(KeptReceipt::Unanswered)
    }

    /// `PUT {node_id}/notif/{uaid}`: ask the node to check storage.
    async fn notify_node(&self, node_id: &str, uaid: &Uuid) {
        if let Some(local) = self.local_for(node_id) {
            local.notify(uaid);
            return;
        }
        if let Err(e) = self.nodes.notify(node_id, uaid).await {
            warn!(node_id, error = %e, "could not notify connection node");
        }
    }
}

#[async_trait]
impl Router for WebPushRouter {
    /// A webpush user registered over `/v1/webpush/...` (a client that polls
    /// or connects later) needs no bridge data.
    fn register(
        &self,
        _input: &RouterDataInput,
        _app_id: &str,
    ) -> Result<serde_json::Value, RouterError> {
        Ok(serde_json::json!({}))
    }

    async fn route_notification(
        &self,
        mut notification: Notification,
        user: &User,
    ) -> ApiResult<Delivery> {
        if user.holds(&notification) {
            return self.hold(notification, user).await;
        }
        if !stores_direct(self.durable_direct, notification.ttl) {
            return self.deliver_kept(notification, user).await;
        }
        let uaid = user.uaid;
        let wake = wake::wake_up_for(&notification);
        let Some(node_id) = &user.node_id else {
            self.storage.save_direct(&uaid, notification).await?;
            return self.stored(&uaid, wake).await;
        };
        // On a store billed per write, the node holds the copy back and
        // writes it only if the client does not ack within the grace. A
        // Topic message is written first as before: it replaces a stored
        // one with its Topic, which must not stay behind to be delivered
        // after it.
        if self.storage.node_holds_direct_copies() && notification.topic.is_none() {
            return self.deliver_held(node_id, user, notification).await;
        }
        // The durable copy is staged before the client can see (and ack)
        // the message; the 201 waits until it is on disk or acked. The copy
        // is what is saved if the push does not reach the client, so the
        // message itself goes to the node.
        let copy = self
            .storage
            .stage_direct(&uaid, notification.clone())
            .await?;
        notification.durable = true;
        if let Some(taken) = self.pushed(node_id, user, notification).await? {
            if self
                .local_for(node_id)
                .is_some_and(|local| local.acks_late(&uaid))
            {
                // Its ack would not come within the store's grace either.
                copy.hurry();
            }
            if copy.saved_or_settled().await? == CopyEnd::Acked {
                // Nothing of it was written, not even its receipt.
                return Ok(Delivery::Acked);
            }
            if let Some(notification) = taken.unsettled {
                // autopush-rs's node: it keeps the message until the ack,
                // and stores it itself if the client leaves without one.
                // Our copy would be delivered again at the next hello.
                // Delivered either way: a failure here is not the sender's.
                if let Err(e) = self.storage.remove_direct_copy(&uaid, &notification).await {
                    warn!(error = %e, "could not remove a durable copy an autopush-rs node took");
                }
            }
            return Ok(Delivery::Direct);
        }
        copy.saved_now().await?;
        self.stored(&uaid, wake).await
    }
}
