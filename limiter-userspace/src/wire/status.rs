//! What `status` and `detach` answer, and how the program is attached to
//! an interface: what the CLI and the daemon's configuration ask for, and
//! what netlink reports an interface runs.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// How to attach: `auto` tries native (driver) mode and falls back to skb.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Auto,
    Native,
    Skb,
}

/// An interface the program is attached to, and how.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Attachment {
    pub iface: String,
    pub mode: Mode,
    /// The link was pinned by an earlier process and the program replaced on it.
    pub adopted: bool,
}

/// The reply to [`Request::Status`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Status {
    pub pin_dir: PathBuf,
    pub rules_file: PathBuf,
    pub interfaces: Vec<Attachment>,
    /// Rule sets applied since the daemon started (the first is 1).
    pub ruleset_generation: u64,
}

/// The reply to [`Request::Detach`]: the interfaces it detached from.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Detached {
    pub detached: Vec<String>,
}
