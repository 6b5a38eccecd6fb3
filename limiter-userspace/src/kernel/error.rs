//! What can go wrong between the limiter and the kernel, each case with
//! what to do about it.

use std::{io, path::PathBuf};

use aya::{maps::MapError, programs::ProgramError};
use limiter_common::abi::MAX_IFACES;

use super::pins;
use crate::wire::Mode;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(
        "this limiter binary was built without its XDP program; build it with `cargo xtask build`"
    )]
    NoObject,
    #[error("loading an XDP program needs root (CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON)")]
    NotPermitted,
    #[error("the kernel rejected the XDP program: {0}")]
    Load(#[source] Box<aya::EbpfError>),
    #[error(
        "the kernel's verifier rejected the XDP program: {0} \
         (LIMITER_LOG=debug prints the whole verifier log)"
    )]
    Verifier(String),
    #[error(
        "Linux {release} is too old for the limiter: it lacks {lacks}; \
         the limiter is tested on Linux {tested} and newer"
    )]
    KernelTooOld {
        release: String,
        lacks: &'static str,
        tested: &'static str,
    },
    #[error(
        "the state pinned at {} was written by an incompatible build ({detail}); \
         `limiter detach --pin-dir {0}` removes it (and every bucket)",
        dir.display()
    )]
    IncompatiblePins { dir: PathBuf, detail: String },
    #[error("the object is not a limiter program: {0}")]
    BadObject(String),
    #[error(
        "no limiter state at {} (is a limiter running? reading it needs root; inside `ip netns exec`, which hides /sys/fs/bpf, use `nsenter --net=/run/netns/NAME` instead)",
        dir.display()
    )]
    NotRunning { dir: PathBuf },
    #[error("no network interface named {0:?}")]
    NoInterface(String),
    #[error("attaching to {iface} in {mode:?} mode failed: {source}")]
    Attach {
        iface: String,
        mode: Mode,
        #[source]
        source: ProgramError,
    },
    #[error("adopting the pinned link {path}: {detail}")]
    Adopt { path: PathBuf, detail: String },
    #[error("more than {} interfaces", MAX_IFACES - 1)]
    TooManyInterfaces,
    #[error("map {name}: {source}")]
    Map {
        name: String,
        #[source]
        source: MapError,
    },
    #[error(transparent)]
    UnsafeDir(#[from] pins::UnsafeDir),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}
