//! Listening so that no client, and no number of clients, can tie a
//! listener up: a cap on the connections served at once (one more is told
//! so and closed), a deadline on every request's header (an idle keep-alive
//! connection included: hyper starts the header timer when it waits for a
//! request, not at its first byte), a deadline on every write (a client
//! that stops reading its answers is cut off, not left holding a slot),
//! and accept errors (file descriptors run out under a connection flood)
//! that back off instead of spinning, logged once per interval with a
//! count.
//!
//! What a listener allows (`limits`), its slots (`slots`), the accept
//! loop (`accept`), one connection (`connection`) and its write deadline
//! (`write_deadline`), a connection read again from its start
//! (`prefixed`), TLS (`tls`).

mod accept;
mod connection;
mod limits;
mod prefixed;
mod slots;
mod tls;
mod write_deadline;

pub use accept::{AcceptErrors, ConnectionError, serve_app, serve_http, serve_http_with};
pub use connection::{MAX_STREAMS, serve_http1};
pub use limits::{Limits, default_per_source};
pub use prefixed::Prefixed;
pub use slots::{Slot, Slots};
pub use tls::tls_acceptor;
