//! One websocket client, from `hello` to close.
//!
//! The session owns the socket. It waits for `hello`, joins the registry,
//! then serves, in one loop: client messages, its inbox in the registry
//! (direct notifications, storage checks, being replaced), and keep-alive
//! pings.
//! Each client message has its own submodule. When the session ends, direct
//! notifications the client never acknowledged are stored, so none is lost.

mod ack;
mod hello;
mod in_flight;
mod ping;
mod register;
mod stored;
mod unregister;
mod urgency;
mod wake;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use autopush_common::Notification;
use autopush_common::ids::uaid_tag;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tracing::{debug, info, warn};
use uuid::Uuid;

use crate::protocol::{ClientMessage, ServerMessage, error_json, notification_json};
use crate::registry::{Inbox, Letter, LiveSession};
use crate::server::Socket;
use crate::{ConnectionSettings, NodeContext};

/// What a client is told when storage failed. The backend's own words
/// (error codes, table names, accounts) go to the log, never to the client.
const STORAGE_UNAVAILABLE: &str = "storage unavailable; try again later";

/// Why a session ends; becomes the websocket close frame.
#[derive(Debug)]
pub struct Close {
    pub code: u16,
    pub reason: String,
    /// The `status` of the error message sent before the close frame.
    pub status: u16,
}

impl Close {
    /// Close with `code`; the error message before it has the status that
    /// code usually means (500 for a server error, 503 for "try again
    /// later", else 401).
    fn new(code: u16, reason: impl Into<String>) -> Self {
        let status = match code {
            1011 => 500,
            1013 => 503,
            _ => 401,
        };
        Close {
            code,
            reason: reason.into(),
            status,
        }
    }

    /// The client broke the protocol.
    fn protocol(reason: impl Into<String>) -> Self {
        Close::new(1008, reason)
    }

    /// The client is over a quota: status 429, and close 1013 (try again
    /// later).
    fn too_many(reason: impl Into<String>) -> Self {
        Close {
            status: 429,
            ..Close::new(1013, reason)
        }
    }

    /// The store failed (after its own retries): close with 1013 "try again
    /// later" so the client backs off and reconnects; the detail stays in
    /// our log.
    fn storage(e: autopush_storage::StorageError) -> Self {
        warn!(error = %e, "storage failed; closing the connection with 1013");
        Close::new(1013, STORAGE_UNAVAILABLE)
    }

    /// Another connection of the same user agent recorded itself while this
    /// one was saying hello: that one stays, this one may try again.
    fn superseded() -> Self {
        Close::new(
            1013,
            "another connection of this user agent took over; try again later",
        )
    }

    /// The socket is gone; nothing to send.
    fn gone() -> Self {
        Close::new(1000, "")
    }
}

type Flow = Result<(), Close>;

/// A session past its hello, to be served on a task of its own.
///
/// A task's allocation is as large as the largest state its future can be
/// in, and an idle session holds its task for hours: the upgrade and the
/// hello run on another task, so this one holds only the serving state. The
/// handlers of client messages and the clean-up are boxed inside it for the
/// same reason.
pub struct Accepted(Session);

impl Accepted {
    /// Serve the client until the websocket closes, then clean up; `guard`
    /// (the connection's slot on this node) is dropped last. Not an `async
    /// fn`: that would keep a second copy of the session in its future (its
    /// arguments, and the locals they are moved into).
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn would hold the session twice"
    )]
    pub fn serve<G: Send + 'static>(self, guard: G) -> impl Future<Output = ()> + Send + 'static {
        let Accepted(mut session) = self;
        async move {
            let outcome = session.serve().await;
            Box::pin(session.finish(outcome)).await;
            drop(guard);
        }
    }
}

/// Wait for the client's `hello` on a new websocket and accept it; the
/// session to run if it was accepted, `None` when it ended there.
/// `client` is the address the quota of new UAIDs counts (`None`: unknown,
/// not counted).
pub async fn hello(
    ctx: Arc<NodeContext>,
    socket: Socket,
    client: Option<IpAddr>,
) -> Option<Accepted> {
    let mut socket = socket;
    let limit = ctx.settings.send_timeout;
    let hello = match timeout(ctx.settings.hello_timeout, first_message(&mut socket)).await {
        Ok(Ok(ClientMessage::Hello { uaid, .. })) => uaid,
        Ok(Ok(_)) => {
            let close_with = Close::protocol("the first message must be hello");
            close(&mut socket, limit, close_with, Some("hello")).await;
            return None;
        }
        Ok(Err(close_with)) => {
            close(&mut socket, limit, close_with, None).await;
            return None;
        }
        Err(_) => {
            close(
                &mut socket,
                limit,
                Close::protocol("no hello in time"),
                None,
            )
            .await;
            return None;
        }
    };
    match hello::accept(&ctx, hello.as_deref(), client, socket).await {
        Ok(session) => Some(Accepted(session)),
        Err((mut socket, close_with)) => {
            close(&mut socket, limit, close_with, Some("hello")).await;
            None
        }
    }
}

/// Read until the first text message, which must parse.
async fn first_message(socket: &mut Socket) -> Result<ClientMessage, Close> {
    loop {
        let Some(Ok(frame)) = socket.receive().await else {
            return Err(Close::gone());
        };
        match frame {
            Message::Close(_) => return Err(Close::gone()),
            Message::Text(text) => {
                return ClientMessage::parse(&text).map_err(|e| Close::protocol(e.reason));
            }
            Message::Binary(_) => {
                return Err(Close::protocol(
                    "binary messages are not part of the protocol",
                ));
            }
            Message::Ping(data) => socket
                .send(Message::Pong(data))
                .await
                .map_err(|_| Close::gone())?,
            _ => {}
        }
    }
}

/// Send one message to the client, or give up on a client that does not take
/// it within `limit`: one that stops reading must not hold its session (and
/// with it pings, kicks and shutdown) hostage. A frame may be half written
/// then, so nothing more can be sent: the connection is just dropped.
async fn send_within(socket: &mut Socket, limit: Duration, message: Message) -> Flow {
    match timeout(limit, socket.send(message)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(Close::gone()),
        Err(_) => {
            debug!(
                ?limit,
                "the client is not taking messages; dropping the connection"
            );
            Err(Close::gone())
        }
    }
}

/// Send an error message (when there is one to answer) and the close frame.
/// Every session ends here exactly once.
async fn close(socket: &mut Socket, limit: Duration, close_with: Close, answering: Option<&str>) {
    autopush_common::metrics::connection_closed(close_with.code);
    if close_with.reason.is_empty() {
        return;
    }
    debug!(code = close_with.code, reason = %close_with.reason, "closing connection");
    let error = error_json(
        answering.unwrap_or("error"),
        close_with.status,
        &close_with.reason,
    );
    if send_within(socket, limit, Message::text(error))
        .await
        .is_err()
    {
        return;
    }
    let mut reason = close_with.reason;
    // A close frame's reason is at most 123 bytes; the reason may quote
    // client text, so cut at a character boundary.
    reason.truncate(reason.floor_char_boundary(120));
    let frame = Message::Close(Some(CloseFrame {
        code: close_with.code.into(),
        reason: reason.into(),
    }));
    if send_within(socket, limit, frame).await.is_ok() {
        let _ = timeout(limit, socket.close()).await;
    }
}

/// The deadlines of a serving session: the next keep-alive ping, the pong
/// it waits for, and the next refresh of the user's `last_connect`. The
/// intervals are the node's settings, passed in rather than copied: an idle
/// session holds this for hours.
struct Deadlines {
    /// The next ping, or, while `awaiting_pong`, when its pong is due.
    ping: Instant,
    awaiting_pong: bool,
    next_refresh: Instant,
}

/// What woke a serving session.
enum Event {
    Frame(Option<Result<Message, crate::websocket::Error>>),
    Letter(Letter),
    /// The timer: a deadline may have come.
    Deadline,
}

/// Which deadline came.
#[derive(Debug, PartialEq)]
enum Due {
    /// Time to ping the client.
    Ping,
    /// The client did not answer the ping.
    Pong,
    /// Time to refresh `last_connect`.
    Refresh,
}

impl Deadlines {
    fn new(settings: &ConnectionSettings, now: Instant) -> Self {
        Deadlines {
            ping: now + settings.auto_ping_interval,
            awaiting_pong: false,
            next_refresh: now + settings.refresh_last_connect,
        }
    }

    /// When the earliest deadline comes.
    fn next(&self) -> Instant {
        self.ping.min(self.next_refresh)
    }

    /// The client sent something: no pong is awaited, and the next ping is
    /// a whole interval away.
    fn heard_from_client(&mut self, now: Instant, settings: &ConnectionSettings) {
        self.awaiting_pong = false;
        self.ping = now + settings.auto_ping_interval;
    }

    /// The ping went out at `now` (it may have waited for a slow client):
    /// its pong is due from then.
    fn pinged(&mut self, now: Instant, settings: &ConnectionSettings) {
        self.awaiting_pong = true;
        self.ping = now + settings.auto_ping_timeout;
    }

    /// The deadline that has come by `now`, if any, moved on as if acted
    /// upon (a ping is taken as sent: its pong is due). A missed pong comes
    /// first; a refresh that falls due with a ping comes on the next call.
    fn due(&mut self, now: Instant, settings: &ConnectionSettings) -> Option<Due> {
        if now >= self.ping {
            if self.awaiting_pong {
                return Some(Due::Pong);
            }
            self.pinged(now, settings);
            return Some(Due::Ping);
        }
        if now >= self.next_refresh {
            self.next_refresh = now + settings.refresh_last_connect;
            return Some(Due::Refresh);
        }
        None
    }
}

pub(crate) struct Session {
    ctx: Arc<NodeContext>,
    socket: Socket,
    uaid: Uuid,
    /// This session's id in the registry.
    session: u64,
    inbox: Arc<Inbox>,
    /// What was sent and is not settled yet: `None`, and nothing
    /// allocated, while there is none.
    in_flight: Option<Box<in_flight::InFlight>>,
    /// Storage may hold more than was sent: look again once all are acked.
    recheck_storage: bool,
    /// What is left of the client's allowance of `{}` pings.
    ping_tokens: ping::PingTokens,
    /// Stored messages this session may still send (`Some` when the client
    /// was over `msg_limit` at hello).
    stored_budget: Option<usize>,
    /// When this connection recorded itself in the user record.
    connected_at: u64,
    /// Messages less urgent than this wait in storage.
    min_urgency: autopush_common::Urgency,
    /// Stored messages the last look at storage found held by
    /// `min_urgency`: the next look fetches past them at once.
    held: usize,
    /// Dropped last, after the clean-up below (or on a panic).
    _live: LiveSession,
}

impl Session {
    async fn serve(&mut self) -> Flow {
        Box::pin(self.check_storage()).await?;
        let mut deadlines = Deadlines::new(&self.ctx.settings, Instant::now());
        // One timer for the three deadlines: an idle session holds it for
        // hours, and each timer is over 100 bytes.
        let timer = sleep_until(deadlines.next());
        tokio::pin!(timer);
        loop {
            // What happened is handled once the select is over, in a boxed
            // future: the task holds the wait or a handler's state, never
            // both.
            let event = tokio::select! {
                frame = self.socket.receive() => Event::Frame(frame),
                letter = self.inbox.next() => Event::Letter(letter),
                () = &mut timer => Event::Deadline,
            };
            Box::pin(self.on_event(event, &mut deadlines)).await?;
            if timer.deadline() != deadlines.next() {
                timer.as_mut().reset(deadlines.next());
            }
        }
    }

    async fn on_event(&mut self, event: Event, deadlines: &mut Deadlines) -> Flow {
        match event {
            Event::Frame(frame) => {
                let Some(Ok(frame)) = frame else {
                    return Err(Close::gone());
                };
                // Any traffic proves the client alive.
                deadlines.heard_from_client(Instant::now(), &self.ctx.settings);
                match frame {
                    Message::Close(frame) => {
                        if frame.is_some_and(|f| u16::from(f.code) == wake::EXPECTS_WAKE_UP) {
                            self.left_to_be_woken();
                        }
                        Err(Close::gone())
                    }
                    Message::Text(text) => self.on_message(&text).await,
                    Message::Binary(_) => Err(Close::protocol(
                        "binary messages are not part of the protocol",
                    )),
                    Message::Ping(data) => self.send_message(Message::Pong(data)).await,
                    _ => Ok(()),
                }
            }
            Event::Letter(Letter::Notification(notification)) => {
                self.send_direct(*notification).await
            }
            Event::Letter(Letter::CheckStorage) => self.check_storage().await,
            Event::Letter(Letter::Kick) => Err(Close::new(
                4000,
                "closed by the server (replaced by a newer connection, or shutting down)",
            )),
            Event::Deadline => match deadlines.due(Instant::now(), &self.ctx.settings) {
                Some(Due::Ping) => {
                    // Silent for a whole interval: an idle client.
                    let now = Instant::now();
                    self.in_flight = self.in_flight.take().and_then(|f| f.shed(now));
                    self.send_message(Message::Ping(Default::default())).await?;
                    deadlines.pinged(Instant::now(), &self.ctx.settings);
                    Ok(())
                }
                Some(Due::Pong) => Err(Close::new(1001, "no pong in time")),
                Some(Due::Refresh) => self.refresh_last_connect().await,
                None => Ok(()),
            },
        }
    }

    /// What was sent and is not settled yet, to read.
    fn in_flight(&self) -> &in_flight::InFlight {
        self.in_flight
            .as_deref()
            .unwrap_or(in_flight::InFlight::none())
    }

    /// What was sent and is not settled yet, to change (allocated then).
    fn in_flight_mut(&mut self) -> &mut in_flight::InFlight {
        self.in_flight.get_or_insert_default()
    }

    async fn on_message(&mut self, text: &str) -> Flow {
        let message = match ClientMessage::parse(text) {
            Ok(message) => message,
            Err(e) => {
                self.send_text(error_json(
                    e.message_type.as_deref().unwrap_or("error"),
                    401,
                    &e.reason,
                ))
                .await?;
                return Err(Close::protocol(e.reason));
            }
        };
        match message {
            ClientMessage::Hello { .. } => Err(Close::protocol("hello was already said")),
            ClientMessage::Register { channel_id, key } => {
                self.register(&channel_id, key.as_deref()).await
            }
            ClientMessage::Unregister { channel_id, code } => {
                self.unregister(&channel_id, code).await
            }
            ClientMessage::Ack { updates } => self.ack(updates).await,
            ClientMessage::Nack {
                updates,
                version,
                code,
            } => self.nack(updates, version, code).await,
            // Broadcasts are not used by this service; accepting keeps Firefox happy.
            ClientMessage::BroadcastSubscribe { .. } => Ok(()),
            ClientMessage::Ping => self.ping().await,
            ClientMessage::Urgency { min } => self.set_min_urgency(&min).await,
            ClientMessage::Wake {
                router,
                app_id,
                token,
            } => {
                self.wake(router.as_deref(), app_id.as_deref(), token.as_deref())
                    .await
            }
        }
    }

    async fn send_text(&mut self, text: String) -> Flow {
        self.send_message(Message::text(text)).await
    }

    async fn send_message(&mut self, message: Message) -> Flow {
        send_within(&mut self.socket, self.ctx.settings.send_timeout, message).await
    }

    async fn send(&mut self, message: &ServerMessage) -> Flow {
        self.send_text(message.to_json()).await
    }

    /// Log a storage failure while serving `what`, with its detail, and
    /// return the reason to give the client (without it).
    fn storage_failed(&self, what: &str, e: &autopush_storage::StorageError) -> &'static str {
        warn!(uaid = %uaid_tag(&self.uaid), error = %e, "{what}: storage failed");
        STORAGE_UNAVAILABLE
    }

    async fn send_direct(&mut self, mut notification: Notification) -> Flow {
        let expired =
            notification.is_expired(autopush_common::time::now_secs()) && notification.ttl > 0;
        // A durable direct message is in storage before it is routed here,
        // so a storage check may have sent (or even settled, or the client
        // nacked) it already.
        let sent_from_storage = self.in_flight().sent_from_storage(&notification.version);
        if expired || sent_from_storage {
            self.inbox.settled_direct();
            return Ok(());
        }
        if notification.is_below(self.min_urgency) {
            // Routed here before the endpoint read the minimum just raised.
            return self.hold_direct(notification).await;
        }
        let message = notification_json(&notification);
        if notification.durable {
            // Its copy is in storage, or with its holder: an ack or a nack
            // settles it by key, and a session that ends writes nothing of
            // it. The payload would only wait here for the ack.
            notification.data = None;
        }
        self.in_flight_mut().unacked(notification, Instant::now());
        self.send_text(message).await
    }

    /// A client connected for long is not idle: say so in its record. If the
    /// user is gone (unregistered over `/v1`), the client must start over
    /// with a new UAID: close, and its next hello gets one.
    async fn refresh_last_connect(&mut self) -> Flow {
        let now = autopush_common::time::now_millis();
        match self.ctx.storage.touch_user(&self.uaid, now).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(Close::new(
                4000,
                "this user agent's registration was removed; say hello again",
            )),
            Err(e) => {
                // Not worth the connection: the next refresh tries again.
                warn!(uaid = %uaid_tag(&self.uaid), error = %e, "could not refresh last_connect");
                Ok(())
            }
        }
    }

    /// Leave the registry, store what the client never acknowledged, close.
    async fn finish(mut self, outcome: Flow) {
        let connected_at = self.ctx.registry.disconnect(&self.uaid, self.session);
        // Nothing can be queued after this; what is queued is drained below.
        for notification in self.inbox.close() {
            self.in_flight_mut().unacked(notification, Instant::now());
        }
        let in_flight = self.in_flight();
        let unacked = !in_flight.unacked_direct.is_empty() || !in_flight.unacked_stored.is_empty();
        if let Err(e) = self.store_unacked_direct().await {
            warn!(uaid = %uaid_tag(&self.uaid), error = %e, "could not store unacknowledged notifications");
        }
        // Messages it never acked wait in storage now, not at a client:
        // the record stops naming this node (unless a newer connection
        // took it over), so their receipts read `stored` again and the
        // next push goes to storage without a call to this node.
        if let Some(connected_at) = connected_at.filter(|_| unacked) {
            let node = self.ctx.node_id();
            if let Err(e) = self
                .ctx
                .storage
                .remove_node_id(&self.uaid, node, connected_at)
                .await
            {
                warn!(uaid = %uaid_tag(&self.uaid), error = %e, "could not clear the node of a client that left");
            }
        }
        let close_with = outcome.err().unwrap_or_else(Close::gone);
        info!(uaid = %uaid_tag(&self.uaid), code = close_with.code, reason = %close_with.reason, "client disconnected");
        close(
            &mut self.socket,
            self.ctx.settings.send_timeout,
            close_with,
            None,
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ConnectionSettings;

    fn settings() -> ConnectionSettings {
        ConnectionSettings {
            auto_ping_interval: Duration::from_secs(300),
            auto_ping_timeout: Duration::from_secs(10),
            refresh_last_connect: Duration::from_secs(1000),
            ..ConnectionSettings::default()
        }
    }

    /// The size of what `f` returns, without making one.
    fn size_of_output<A, R>(_f: impl Fn(A) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// An idle client's task holds its serving future (the session, its
    /// deadlines and timer, the wait on the socket and the inbox) for hours.
    /// tokio adds about 100 bytes of its own and rounds a task up to a
    /// multiple of 128 (two cache lines): a serving future of 536 bytes or
    /// less makes a task of 640. The bound catches what made it grow before:
    /// a handler's or the hello's state inlined in it instead of boxed, a
    /// handler awaited while the select's futures were still held, copies of
    /// settings, or a second copy of the session.
    #[test]
    fn an_idle_session_holds_a_task_of_640_bytes() {
        let serving = size_of_output(|session: Session| Accepted(session).serve(()));
        assert!(
            serving <= 536,
            "the serving future is {serving} bytes; box what an idle session does not need"
        );
        let socket = std::mem::size_of::<Socket>();
        assert!(
            socket <= 128,
            "the websocket is {socket} bytes; it should hold its buffers on the heap, and only while in use"
        );
    }

    #[test]
    fn a_silent_client_is_pinged_then_closed_without_a_pong() {
        let start = Instant::now();
        let settings = settings();
        let mut deadlines = Deadlines::new(&settings, start);
        assert_eq!(deadlines.next(), start + Duration::from_secs(300));
        assert_eq!(
            deadlines.due(start + Duration::from_secs(299), &settings),
            None
        );
        let pinged = start + Duration::from_secs(300);
        assert_eq!(deadlines.due(pinged, &settings), Some(Due::Ping));
        assert_eq!(deadlines.next(), pinged + Duration::from_secs(10));
        assert_eq!(
            deadlines.due(pinged + Duration::from_secs(9), &settings),
            None
        );
        assert_eq!(
            deadlines.due(pinged + Duration::from_secs(10), &settings),
            Some(Due::Pong)
        );
    }

    #[test]
    fn the_pong_is_due_from_when_the_ping_went_out() {
        let start = Instant::now();
        let settings = settings();
        let mut deadlines = Deadlines::new(&settings, start);
        let due = start + Duration::from_secs(300);
        assert_eq!(deadlines.due(due, &settings), Some(Due::Ping));
        let sent = due + Duration::from_secs(3);
        deadlines.pinged(sent, &settings);
        assert_eq!(deadlines.next(), sent + Duration::from_secs(10));
        assert_eq!(
            deadlines.due(due + Duration::from_secs(10), &settings),
            None
        );
    }

    #[test]
    fn any_frame_answers_the_ping_and_moves_the_next_one() {
        let start = Instant::now();
        let settings = settings();
        let mut deadlines = Deadlines::new(&settings, start);
        let pinged = start + Duration::from_secs(300);
        assert_eq!(deadlines.due(pinged, &settings), Some(Due::Ping));
        let pong = pinged + Duration::from_secs(1);
        deadlines.heard_from_client(pong, &settings);
        assert_eq!(deadlines.next(), pong + Duration::from_secs(300));
        assert_eq!(
            deadlines.due(pinged + Duration::from_secs(10), &settings),
            None
        );
    }

    #[test]
    fn a_refresh_due_with_a_ping_comes_right_after_it() {
        let start = Instant::now();
        let settings = ConnectionSettings {
            refresh_last_connect: Duration::from_secs(300),
            ..settings()
        };
        let mut deadlines = Deadlines::new(&settings, start);
        let at = start + Duration::from_secs(300);
        assert_eq!(deadlines.next(), at);
        assert_eq!(deadlines.due(at, &settings), Some(Due::Ping));
        assert_eq!(deadlines.next(), at);
        assert_eq!(deadlines.due(at, &settings), Some(Due::Refresh));
        assert_eq!(deadlines.next(), at + Duration::from_secs(10));
        assert_eq!(deadlines.due(at, &settings), None);
    }

    #[test]
    fn refreshes_come_while_the_client_keeps_talking() {
        let start = Instant::now();
        let settings = settings();
        let mut deadlines = Deadlines::new(&settings, start);
        let mut now = start;
        let mut refreshes = 0;
        for _ in 0..100 {
            now += Duration::from_secs(100);
            deadlines.heard_from_client(now, &settings);
            while let Some(due) = deadlines.due(now, &settings) {
                assert_eq!(due, Due::Refresh);
                refreshes += 1;
            }
        }
        assert_eq!(refreshes, 10);
    }
}
