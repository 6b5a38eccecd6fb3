//! Cleartext HTTP/1.1 requests without a body (most requests), relayed by
//! the proxy itself: the head is read with httparse, judged by the same
//! layer as every other request, written to one of the worker's upstream
//! connections in one write, and the answer passed back as it comes, its
//! head and first bytes in one write. No task, channel or body object per
//! request: this is the path that carries the load, and it does what
//! nginx does for it.
//!
//! Anything else a connection brings (a body, an upgrade, `Expect`,
//! HTTP/1.0, a target not in origin form, a head httparse refuses or
//! that is too large) hands the connection, with the bytes already read,
//! to hyper and the proxy's full service for the rest of its life: they
//! answer it as before, 400 and 431 included.

mod answer;
mod connection;
mod io;
mod request;

pub use connection::Relay;
