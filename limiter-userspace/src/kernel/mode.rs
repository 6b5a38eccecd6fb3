//! How the program is attached to an interface: what the CLI and the
//! daemon's configuration ask for (`links`), and what netlink reports an
//! interface runs (`netlink`).

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
