//! [`MeteredStorage`]: any backend, with the latency of every operation and
//! its failures recorded (`storage.time`, `storage.error`), so backends
//! need no metrics code of their own.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use autopush_common::metrics::storage_op;
use autopush_common::{Notification, Urgency, User, WakeRoute};
use uuid::Uuid;

use crate::{DirectCopy, Result, Storage, StoredMessage, SweepStep};
use autopush_common::receipt::MessageState;

pub struct MeteredStorage {
    inner: Arc<dyn Storage>,
    /// The backend's name in labels (`embedded`, `dynamodb`).
    backend: &'static str,
}

impl MeteredStorage {
    pub fn new(inner: Arc<dyn Storage>, backend: &'static str) -> Self {
        MeteredStorage { inner, backend }
    }

    async fn timed<T>(&self, op: &'static str, call: impl Future<Output = Result<T>>) -> Result<T> {
        let started = Instant::now();
        let result = call.await;
        storage_op(self.backend, op, result.is_ok(), started.elapsed());
        result
    }
}

#[async_trait]
impl Storage for MeteredStorage {
    async fn add_user(&self, user: &User) -> Result<()> {
        self.timed("add_user", self.inner.add_user(user)).await
    }

    async fn take_over_user(&self, user: &User, seen_connected_at: u64) -> Result<bool> {
        let call = self.inner.take_over_user(user, seen_connected_at);
        self.timed("take_over_user", call).await
    }

    async fn touch_user(&self, uaid: &Uuid, last_connect: u64) -> Result<bool> {
        let call = self.inner.touch_user(uaid, last_connect);
        self.timed("touch_user", call).await
    }

    async fn set_router_data(
        &self,
        uaid: &Uuid,
        seen: Option<&serde_json::Value>,
        router_data: &serde_json::Value,
    ) -> Result<bool> {
        let call = self.inner.set_router_data(uaid, seen, router_data);
        self.timed("set_router_data", call).await
    }

    async fn remove_user_if_unchanged(&self, seen: &User) -> Result<bool> {
        let call = self.inner.remove_user_if_unchanged(seen);
        self.timed("remove_user_if_unchanged", call).await
    }

    async fn get_user(&self, uaid: &Uuid) -> Result<Option<User>> {
        self.timed("get_user", self.inner.get_user(uaid)).await
    }

    async fn remove_user(&self, uaid: &Uuid) -> Result<()> {
        self.timed("remove_user", self.inner.remove_user(uaid))
            .await
    }

    async fn remove_node_id(&self, uaid: &Uuid, node_id: &str, connected_at: u64) -> Result<bool> {
        let call = self.inner.remove_node_id(uaid, node_id, connected_at);
        self.timed("remove_node_id", call).await
    }

    async fn set_min_urgency(
        &self,
        uaid: &Uuid,
        node_id: &str,
        connected_at: u64,
        min: Urgency,
    ) -> Result<bool> {
        let call = self.inner.set_min_urgency(uaid, node_id, connected_at, min);
        self.timed("set_min_urgency", call).await
    }

    async fn set_wake_route(&self, uaid: &Uuid, route: Option<&WakeRoute>) -> Result<bool> {
        let call = self.inner.set_wake_route(uaid, route);
        self.timed("set_wake_route", call).await
    }

    async fn remove_wake_route(&self, uaid: &Uuid, seen: &WakeRoute) -> Result<bool> {
        let call = self.inner.remove_wake_route(uaid, seen);
        self.timed("remove_wake_route", call).await
    }

    async fn claim_wake(&self, uaid: &Uuid, seen: u64, now: u64) -> Result<bool> {
        let call = self.inner.claim_wake(uaid, seen, now);
        self.timed("claim_wake", call).await
    }

    async fn add_channel(&self, uaid: &Uuid, channel_id: &Uuid, limit: usize) -> Result<bool> {
        let call = self.inner.add_channel(uaid, channel_id, limit);
        self.timed("add_channel", call).await
    }

    async fn get_channels(&self, uaid: &Uuid) -> Result<HashSet<Uuid>> {
        self.timed("get_channels", self.inner.get_channels(uaid))
            .await
    }

    async fn has_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool> {
        let call = self.inner.has_channel(uaid, channel_id);
        self.timed("has_channel", call).await
    }

    async fn get_user_and_channel(
        &self,
        uaid: &Uuid,
        channel_id: &Uuid,
    ) -> Result<Option<(User, bool)>> {
        let call = self.inner.get_user_and_channel(uaid, channel_id);
        self.timed("get_user_and_channel", call).await
    }

    async fn remove_channel(&self, uaid: &Uuid, channel_id: &Uuid) -> Result<bool> {
        let call = self.inner.remove_channel(uaid, channel_id);
        self.timed("remove_channel", call).await
    }

    async fn save_messages(&self, uaid: &Uuid, messages: Vec<Notification>) -> Result<()> {
        let call = self.inner.save_messages(uaid, messages);
        self.timed("save_messages", call).await
    }

    async fn save_direct(&self, uaid: &Uuid, message: Notification) -> Result<()> {
        let call = self.inner.save_direct(uaid, message);
        self.timed("save_direct", call).await
    }

    async fn stage_direct(&self, uaid: &Uuid, message: Notification) -> Result<DirectCopy> {
        let call = self.inner.stage_direct(uaid, message);
        self.timed("stage_direct", call).await
    }

    fn node_holds_direct_copies(&self) -> bool {
        self.inner.node_holds_direct_copies()
    }

    async fn settle_unwritten(
        &self,
        uaid: &Uuid,
        message: &Notification,
        state: MessageState,
    ) -> Result<()> {
        let call = self.inner.settle_unwritten(uaid, message, state);
        self.timed("settle_unwritten", call).await
    }

    async fn remove_direct_copy(&self, uaid: &Uuid, message: &Notification) -> Result<bool> {
        let call = self.inner.remove_direct_copy(uaid, message);
        self.timed("remove_direct_copy", call).await
    }

    async fn fetch_messages(&self, uaid: &Uuid, limit: usize) -> Result<Vec<Notification>> {
        let call = self.inner.fetch_messages(uaid, limit);
        self.timed("fetch_messages", call).await
    }

    async fn count_messages(&self, uaid: &Uuid, up_to: usize) -> Result<usize> {
        let call = self.inner.count_messages(uaid, up_to);
        self.timed("count_messages", call).await
    }

    async fn remove_message(&self, uaid: &Uuid, sort_key: &str, version: &str) -> Result<bool> {
        let call = self.inner.remove_message(uaid, sort_key, version);
        self.timed("remove_message", call).await
    }

    async fn settle_message(
        &self,
        uaid: &Uuid,
        sort_key: &str,
        version: &str,
        state: MessageState,
    ) -> Result<bool> {
        let call = self.inner.settle_message(uaid, sort_key, version, state);
        self.timed("settle_message", call).await
    }

    async fn settle_messages(
        &self,
        uaid: &Uuid,
        messages: &[(String, String)],
        state: MessageState,
    ) -> Result<Vec<bool>> {
        let call = self.inner.settle_messages(uaid, messages, state);
        self.timed("settle_messages", call).await
    }

    async fn read_message(&self, uaid: &Uuid, sort_key: &str) -> Result<Option<StoredMessage>> {
        let call = self.inner.read_message(uaid, sort_key);
        self.timed("read_message", call).await
    }

    async fn health_check(&self) -> Result<()> {
        self.timed("health_check", self.inner.health_check()).await
    }

    async fn sweep_expired_messages(&self, budget: usize) -> Result<SweepStep> {
        let call = self.inner.sweep_expired_messages(budget);
        self.timed("sweep_expired_messages", call).await
    }

    async fn drop_idle_users(&self, last_connect_before: u64, budget: usize) -> Result<SweepStep> {
        let call = self.inner.drop_idle_users(last_connect_before, budget);
        self.timed("drop_idle_users", call).await
    }
}
