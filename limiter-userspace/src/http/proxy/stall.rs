//! An upstream's response body that must keep arriving: a pause longer
//! than the upstream timeout between two frames ends it with an error, so
//! an upstream that sends a head and then stalls does not hold the
//! client's connection (and its slot) for as long as the client waits.

use std::{
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

pub struct Stalling<B> {
    inner: B,
    idle: Duration,
    /// Started when the body first keeps the client waiting: a body that
    /// is there at once (most are) costs no timer.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<B> Stalling<B> {
    pub fn new(inner: B, idle: Duration) -> Self {
        Self {
            inner,
            idle,
            timer: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the upstream's answer stopped arriving")]
struct Stalled;

impl<B> Body for Stalling<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => {
                let idle = this.idle;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(Stalled)))),
                    Poll::Pending => Poll::Pending,
                }
            }
            Poll::Ready(frame) => {
                if let Some(timer) = this.timer.as_mut() {
                    timer.as_mut().reset(Instant::now() + this.idle);
                }
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
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
