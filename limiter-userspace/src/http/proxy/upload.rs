//! A request body on its way to the upstream, watched as it streams: cut
//! when it passes the size cap or when its rule's byte limit refuses it (a
//! chunked upload, charged as it arrives), and its progress kept for the
//! proxy's watchdog ([`Progress`]), which cuts a body that stops arriving
//! and times the upstream from the moment it has the whole request. The
//! proxy then answers for the upstream (413, 429, 408 or 502).

use std::{
    pin::Pin,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, Waker},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::http::BodyCharge;

/// Body bytes charged to a byte limit at once: a client sending one-byte
/// chunks costs the limiter one charge per 16 KiB, not one per chunk.
const CHARGE_BATCH: u64 = 16 * 1024;

/// Why a body was cut short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    TooLarge,
    OverLimit,
    Stalled,
    /// Not whole by the body deadline.
    TooSlow,
}

impl Cut {
    /// Why a body still arriving is cut once its time is up: its
    /// whole-body `deadline` passed, or else it paused too long.
    pub fn timed_out(deadline: Instant) -> Self {
        if Instant::now() >= deadline {
            Self::TooSlow
        } else {
            Self::Stalled
        }
    }
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::TooLarge => "the request body is over the size cap",
            Self::OverLimit => "the request body is over its byte limit",
            Self::Stalled => "the request body stopped arriving",
            Self::TooSlow => "the request body took longer than allowed",
        })
    }
}

impl std::error::Error for Cut {}

/// How far a body has come: when it last moved, and whether it has all
/// been read. Shared with the watchdog, which does not depend on the
/// body being polled (an upstream that stops reading stops the polling).
pub struct Progress {
    state: Mutex<(Instant, bool)>,
    cut: OnceLock<Cut>,
    /// Told when the body moves (a permit waits if no one listens).
    moved: tokio::sync::Notify,
    /// The body's reader waits on the client (not the client on it).
    waiting_on_client: AtomicBool,
    /// Wakes the body's reader, to see a cut.
    waker: Mutex<Option<Waker>>,
}

impl Progress {
    /// When the body last moved, and whether it is whole.
    pub fn get(&self) -> (Instant, bool) {
        *self.state.lock().expect("progress lock")
    }

    fn moved(&self, done: bool) {
        *self.state.lock().expect("progress lock") = (Instant::now(), done);
        self.moved.notify_one();
    }

    /// Returns once the body has moved since the last call.
    pub async fn moved_since(&self) {
        self.moved.notified().await;
    }

    /// Why the body was cut short, if it was.
    pub fn cut(&self) -> Option<Cut> {
        self.cut.get().copied()
    }

    /// Cuts the body short (the first reason stands), and wakes its
    /// reader to end it.
    pub fn cut_short(&self, why: Cut) {
        let _ = self.cut.set(why);
        if let Some(waker) = self.waker.lock().expect("waker lock").take() {
            waker.wake();
        }
    }

    /// Whether the body's reader last found the client had sent nothing
    /// more (a stall is the client's), rather than the body not being read
    /// at all (the upstream's).
    pub fn waiting_on_client(&self) -> bool {
        self.waiting_on_client.load(Ordering::Relaxed)
    }

    /// Watches a body that is still arriving after the upstream answered:
    /// cut once it pauses longer than `idle`, or at `deadline` (hyper goes
    /// on sending a body after the answer's head).
    pub async fn watch(self: Arc<Self>, idle: std::time::Duration, deadline: Instant) {
        loop {
            let (moved, whole) = self.get();
            if whole || self.cut().is_some() {
                return;
            }
            let due = (moved + idle).min(deadline);
            if Instant::now() >= due {
                self.cut_short(Cut::timed_out(deadline));
                return;
            }
            tokio::select! {
                () = tokio::time::sleep_until(due) => {}
                () = self.moved_since() => {}
            }
        }
    }
}

pub struct Upload {
    inner: Incoming,
    received: u64,
    /// Received but not yet charged (see [`CHARGE_BATCH`]).
    uncharged: u64,
    max: u64,
    charge: Option<BodyCharge>,
    progress: Arc<Progress>,
}

impl Upload {
    pub fn new(inner: Incoming, max: u64, charge: Option<BodyCharge>) -> Self {
        let done = inner.is_end_stream();
        Self {
            inner,
            received: 0,
            uncharged: 0,
            max,
            charge,
            progress: Arc::new(Progress {
                state: Mutex::new((Instant::now(), done)),
                cut: OnceLock::new(),
                moved: tokio::sync::Notify::new(),
                waiting_on_client: AtomicBool::new(false),
                waker: Mutex::new(None),
            }),
        }
    }

    pub fn progress(&self) -> Arc<Progress> {
        Arc::clone(&self.progress)
    }

    fn cut_short(&mut self, why: Cut) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.progress.cut_short(why);
        Poll::Ready(Some(Err(Box::new(why))))
    }

    /// Charges what was received and not yet charged, in batches (never
    /// more at once than the rule's byte limits could ever admit), the
    /// rest once the body is whole; `false`: over the limit.
    fn charge(&mut self, whole: bool) -> bool {
        let Some(charge) = &self.charge else {
            return true;
        };
        let batch = CHARGE_BATCH.min(charge.max_cost()).max(1);
        while self.uncharged >= batch || (whole && self.uncharged > 0) {
            let piece = self.uncharged.min(batch);
            if !charge.charge(piece) {
                return false;
            }
            self.uncharged -= piece;
        }
        true
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Body for Upload {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(why) = this.progress.cut() {
            // The watchdog gave up on it.
            return Poll::Ready(Some(Err(Box::new(why))));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => {
                *this.progress.waker.lock().expect("waker lock") = Some(cx.waker().clone());
                this.progress
                    .waiting_on_client
                    .store(true, Ordering::Relaxed);
                Poll::Pending
            }
            Poll::Ready(Some(Ok(frame))) => {
                this.progress
                    .waiting_on_client
                    .store(false, Ordering::Relaxed);
                if let Some(data) = frame.data_ref() {
                    let n = data.len() as u64;
                    this.received += n;
                    this.uncharged += n;
                    if this.received > this.max {
                        return this.cut_short(Cut::TooLarge);
                    }
                }
                // A body with a length ends with its last data frame:
                // nothing polls it again to see the end.
                let whole = this.inner.is_end_stream();
                if !this.charge(whole) {
                    return this.cut_short(Cut::OverLimit);
                }
                this.progress.moved(whole);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
            Poll::Ready(None) => {
                if !this.charge(true) {
                    return this.cut_short(Cut::OverLimit);
                }
                this.progress.moved(true);
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
