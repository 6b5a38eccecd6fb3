//! The kernel side as userspace drives it: the embedded XDP object and its
//! loading ([`object`]), one typed handle per map ([`maps`]), the rule
//! tables in two generations ([`generations`]), manual blocks ([`blocks`]),
//! attaching, adopting and detaching ([`links`]), the counters
//! ([`counters`]), batched reads of the key map ([`keys`]), and where state
//! is pinned ([`pins`]).

pub mod blocks;
pub mod capabilities;
pub mod counters;
mod datapath;
mod error;
pub mod flip;
pub mod generations;
pub mod keys;
pub mod links;
pub mod mapped;
pub mod maps;
pub mod netlink;
pub mod object;
pub mod offloads;
pub mod pins;
pub mod repin;
pub mod report;
pub mod trace;

pub use datapath::Datapath;
pub use error::KernelError;
pub use links::{detach_all, if_index};
pub use maps::Maps;
pub use object::{OBJECT, PROGRAM};

/// Fails with a clear message unless running as root.
pub fn require_root() -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        anyhow::bail!(
            "this needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN for bpffs); try sudo"
        );
    }
    Ok(())
}
