//! `limiter proxy`: a small HTTP/1.1 and HTTP/2 (h2c) reverse proxy that applies the rule
//! file to requests before forwarding them, so an operator gets L7 limits
//! without writing code. Cleartext HTTP/1.1 requests without a body, most
//! of the load, are relayed by the proxy itself ([`relay`]); everything
//! else goes through hyper and the service below.
//!
//! Bad clients cannot tie it up: connections are capped (one more gets
//! 503), headers must arrive within the header timeout (slow senders and
//! idle keep-alive connections are cut off), header blocks are bounded
//! (larger ones get 431), malformed requests get 400, a body must keep
//! arriving (408 when it stalls) and stay under a size cap (413), and a
//! client that drops its connection only ends that connection's task.
//! A chunked upload under a byte limit is charged as it streams and cut
//! (429) when over. CONNECT is refused (405): this is not a forward proxy.
//! An upstream that cannot be reached gets the client a 502, which says
//! nothing of why (the log does); one whose answer stops arriving for the
//! upstream timeout has its answer cut (the connection closes); that request was already charged, since
//! the limiter decides before forwarding.

mod answers;
mod chunked;
mod forward;
mod held;
mod hop_by_hop;
mod relay;
mod serve;
mod stall;
mod target;
mod upload;
mod upstream;

pub use serve::{Options, RenderMetrics, serve};
