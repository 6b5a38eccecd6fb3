//! A response body that keeps its request counted in flight (its rule's
//! `concurrent` limit) until the body has been sent or dropped: a slow
//! download is in flight for as long as it lasts, as nginx's `limit_conn`
//! counts it.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use http_body::{Body, Frame, SizeHint};

use crate::http::InFlight;

pub struct Held<B> {
    inner: B,
    _in_flight: Arc<InFlight>,
}

impl<B> Held<B> {
    pub fn new(inner: B, in_flight: Arc<InFlight>) -> Self {
        Self {
            inner,
            _in_flight: in_flight,
        }
    }
}

impl<B: Body + Unpin> Body for Held<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
