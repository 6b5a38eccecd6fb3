//! A request body on its way to the upstream, watched as it streams: cut
//! when it passes the size cap, when its rule's byte limit refuses a chunk
//! (a chunked upload, charged as it arrives), or when it stops arriving.
//! The proxy then answers for the upstream (413, 429 or 408).

use std::{
    pin::Pin,
    sync::{Arc, OnceLock},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::{
    sync::Notify,
    time::{Instant, Sleep},
};

use crate::http::BodyCharge;

/// Why a body was cut short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    TooLarge,
    OverLimit,
    Stalled,
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::TooLarge => "the request body is over the size cap",
            Self::OverLimit => "the request body is over its byte limit",
            Self::Stalled => "the request body stopped arriving",
        })
    }
}

impl std::error::Error for Cut {}

pub struct Upload {
    inner: Incoming,
    received: u64,
    max: u64,
    charge: Option<BodyCharge>,
    idle: Duration,
    stall: Pin<Box<Sleep>>,
    cut: Arc<OnceLock<Cut>>,
    /// Told when the body has been read to its end.
    sent: Arc<Notify>,
}

impl Upload {
    pub fn new(inner: Incoming, max: u64, idle: Duration, charge: Option<BodyCharge>) -> Self {
        let sent = Arc::new(Notify::new());
        if inner.is_end_stream() {
            // No body: nothing will read it to its end.
            sent.notify_one();
        }
        Self {
            inner,
            received: 0,
            max,
            charge,
            idle,
            stall: Box::pin(tokio::time::sleep(idle)),
            cut: Arc::new(OnceLock::new()),
            sent,
        }
    }

    /// Why the body was cut short, once it has been.
    pub fn cut(&self) -> Arc<OnceLock<Cut>> {
        Arc::clone(&self.cut)
    }

    /// Notified once the whole body has been read.
    pub fn sent(&self) -> Arc<Notify> {
        Arc::clone(&self.sent)
    }

    fn cut_short(&mut self, why: Cut) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let _ = self.cut.set(why);
        Poll::Ready(Some(Err(Box::new(why))))
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
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => {
                if this.stall.as_mut().poll(cx).is_ready() {
                    return this.cut_short(Cut::Stalled);
                }
                Poll::Pending
            }
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let n = data.len() as u64;
                    this.received += n;
                    if this.received > this.max {
                        return this.cut_short(Cut::TooLarge);
                    }
                    if this.charge.as_ref().is_some_and(|c| !c.charge(n)) {
                        return this.cut_short(Cut::OverLimit);
                    }
                }
                let next = Instant::now() + this.idle;
                this.stall.as_mut().reset(next);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
            Poll::Ready(None) => {
                this.sent.notify_one();
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
