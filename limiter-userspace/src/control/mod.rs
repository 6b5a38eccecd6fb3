//! The daemon's control interface: the protocol's types ([`protocol`]),
//! the socket side that frames requests and answers ([`server`]), and the
//! typed client the CLI uses ([`client`]).

pub mod client;
pub mod protocol;
pub mod server;

pub use client::Client;
pub use protocol::{DEFAULT_SOCKET, Request, Response};
