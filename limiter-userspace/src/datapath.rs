//! Loads the embedded XDP program, fills its maps from a rule set, pins the
//! maps and attaches the program to interfaces.

use std::{
    ffi::CString,
    io,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, LpmTrie, MapError, lpm_trie::Key},
    programs::{ProgramError, Xdp, xdp::XdpMode},
};
use limiter_common::abi::{Candidates, GlobalConfig, RuleConfig, map_name};

use crate::tables::Tables;

/// The XDP object `cargo xtask build` compiled, embedded at build time.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter.bpf.o"));

/// The program's name in the object.
pub const PROGRAM: &str = "limiter";

/// Every map, in the order they are pinned.
pub const MAPS: [&str; 7] = [
    map_name::CONFIG,
    map_name::RULES,
    map_name::LPM_V4,
    map_name::LPM_V6,
    map_name::KEYS,
    map_name::RULE_STATS,
    map_name::GLOBAL_STATS,
];

/// How to attach: `auto` tries native (driver) mode and falls back to skb.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Auto,
    Native,
    Skb,
}

#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error(
        "this limiter binary was built without its XDP program; build it with `cargo xtask build`"
    )]
    NoObject,
    #[error("loading an XDP program needs root (CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON)")]
    NotPermitted,
    #[error("the kernel rejected the XDP program: {0}")]
    Load(#[source] Box<aya::EbpfError>),
    #[error(
        "the kernel's verifier rejected the XDP program (it needs Linux 5.12 or newer): {0} \
         (LIMITER_LOG=debug prints the whole verifier log)"
    )]
    Verifier(String),
    #[error("no network interface named {0:?}")]
    NoInterface(String),
    #[error("attaching to {iface} in {mode:?} mode failed: {source}")]
    Attach {
        iface: String,
        mode: Mode,
        #[source]
        source: ProgramError,
    },
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("creating {path}: {source}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
}

fn map_error(name: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    move |source| DatapathError::Map { name, source }
}

/// A loaded (not yet attached) limiter program and its maps.
pub struct Datapath {
    ebpf: Ebpf,
}

/// An interface the program is attached to, and how.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Attachment {
    pub iface: String,
    pub mode: Mode,
}

impl Datapath {
    /// Loads the embedded object with room for `max_keys` tracked keys.
    pub fn load(max_keys: u32) -> Result<Self, DatapathError> {
        Self::load_object(OBJECT, max_keys)
    }

    /// Loads a given object (tests load variants of the program).
    pub fn load_object(object: &[u8], max_keys: u32) -> Result<Self, DatapathError> {
        if object.is_empty() {
            return Err(DatapathError::NoObject);
        }
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(map_name::KEYS, max_keys)
            .load(object)
            .map_err(|e| match &e {
                aya::EbpfError::MapError(MapError::CreateError { io_error, .. })
                    if io_error.raw_os_error() == Some(libc::EPERM) =>
                {
                    DatapathError::NotPermitted
                }
                _ => DatapathError::Load(Box::new(e)),
            })?;
        let program: &mut Xdp = ebpf
            .program_mut(PROGRAM)
            .ok_or(DatapathError::NoObject)?
            .try_into()
            .map_err(|_| DatapathError::NoObject)?;
        program.load().map_err(|e| match e {
            // EPERM is a missing capability; EACCES and EINVAL are the verifier.
            ProgramError::LoadError { io_error, .. }
                if io_error.raw_os_error() == Some(libc::EPERM) =>
            {
                DatapathError::NotPermitted
            }
            ProgramError::LoadError { verifier_log, .. } => {
                let log = verifier_log.to_string();
                tracing::debug!("verifier log:\n{log}");
                DatapathError::Verifier(verifier_verdict(&log).to_owned())
            }
            other => DatapathError::Load(Box::new(aya::EbpfError::ProgramError(other))),
        })?;
        Ok(Self { ebpf })
    }

    /// Writes a rule set's tables into the (fresh) maps.
    pub fn write_tables(&mut self, tables: &Tables) -> Result<(), DatapathError> {
        let mut config: Array<_, GlobalConfig> = Array::try_from(self.map_mut(map_name::CONFIG)?)
            .map_err(map_error(map_name::CONFIG))?;
        config
            .set(0, tables.global, 0)
            .map_err(map_error(map_name::CONFIG))?;
        let mut rules: Array<_, RuleConfig> =
            Array::try_from(self.map_mut(map_name::RULES)?).map_err(map_error(map_name::RULES))?;
        for (id, rule) in tables.rules.iter().enumerate() {
            rules
                .set(id as u32, rule, 0)
                .map_err(map_error(map_name::RULES))?;
        }
        let mut v4: LpmTrie<_, [u8; 4], Candidates> =
            LpmTrie::try_from(self.map_mut(map_name::LPM_V4)?)
                .map_err(map_error(map_name::LPM_V4))?;
        for (prefix, addr, candidates) in &tables.v4 {
            v4.insert(&Key::new(*prefix, *addr), candidates, 0)
                .map_err(map_error(map_name::LPM_V4))?;
        }
        let mut v6: LpmTrie<_, [u8; 16], Candidates> =
            LpmTrie::try_from(self.map_mut(map_name::LPM_V6)?)
                .map_err(map_error(map_name::LPM_V6))?;
        for (prefix, addr, candidates) in &tables.v6 {
            v6.insert(&Key::new(*prefix, *addr), candidates, 0)
                .map_err(map_error(map_name::LPM_V6))?;
        }
        Ok(())
    }

    /// Pins every map under `dir` (created if missing).
    pub fn pin(&self, dir: &Path) -> Result<(), DatapathError> {
        std::fs::create_dir_all(dir).map_err(|source| DatapathError::CreateDir {
            path: dir.to_owned(),
            source,
        })?;
        for name in MAPS {
            let path = dir.join(name);
            self.map(name)?
                .pin(&path)
                .map_err(|source| DatapathError::Pin { path, source })?;
        }
        Ok(())
    }

    /// Attaches to `iface`; `auto` falls back from native to skb mode.
    pub fn attach(&mut self, iface: &str, mode: Mode) -> Result<Attachment, DatapathError> {
        if_index(iface)?;
        let attempts: &[Mode] = match mode {
            Mode::Auto => &[Mode::Native, Mode::Skb],
            Mode::Native => &[Mode::Native],
            Mode::Skb => &[Mode::Skb],
        };
        let mut last = None;
        for &attempt in attempts {
            let flags = match attempt {
                Mode::Skb => XdpMode::Skb,
                _ => XdpMode::Driver,
            };
            match self.program_mut().attach(iface, flags) {
                Ok(_) => {
                    return Ok(Attachment {
                        iface: iface.to_owned(),
                        mode: attempt,
                    });
                }
                Err(source) => {
                    if mode == Mode::Auto {
                        tracing::warn!(
                            iface,
                            "native XDP attach failed ({source}); trying skb mode"
                        );
                    }
                    last = Some(DatapathError::Attach {
                        iface: iface.to_owned(),
                        mode: attempt,
                        source,
                    });
                }
            }
        }
        Err(last.expect("at least one attempt"))
    }

    pub fn program(&self) -> &Xdp {
        self.ebpf
            .program(PROGRAM)
            .and_then(|p| p.try_into().ok())
            .expect("checked at load")
    }

    fn program_mut(&mut self) -> &mut Xdp {
        self.ebpf
            .program_mut(PROGRAM)
            .and_then(|p| p.try_into().ok())
            .expect("checked at load")
    }

    pub fn map(&self, name: &'static str) -> Result<&aya::maps::Map, DatapathError> {
        self.ebpf.map(name).ok_or(DatapathError::NoObject)
    }

    pub fn map_mut(&mut self, name: &'static str) -> Result<&mut aya::maps::Map, DatapathError> {
        self.ebpf.map_mut(name).ok_or(DatapathError::NoObject)
    }
}

/// The line of a verifier log that says why it refused: the last one
/// before the statistics it ends with.
fn verifier_verdict(log: &str) -> &str {
    log.lines()
        .rev()
        .map(str::trim)
        .find(|l| {
            !l.is_empty()
                && !l.starts_with("verification time")
                && !l.starts_with("stack depth")
                && !l.starts_with("processed ")
        })
        .unwrap_or("no verifier log")
}

/// The index of `iface` in the calling thread's network namespace.
pub fn if_index(iface: &str) -> Result<u32, DatapathError> {
    let name = CString::new(iface).map_err(|_| DatapathError::NoInterface(iface.to_owned()))?;
    // SAFETY: valid NUL-terminated string.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(DatapathError::NoInterface(iface.to_owned())),
        index => Ok(index),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn verifier_verdict_is_the_reason_line() {
        let log = "683: (79) r4 = *(u64 *)(r10 -64)\n684: (54) w4 &= 65535\nR4 32-bit pointer arithmetic prohibited\nverification time 97473 usec\nstack depth 192+0\nprocessed 9597 insns (limit 1000000)\n";
        assert_eq!(
            super::verifier_verdict(log),
            "R4 32-bit pointer arithmetic prohibited"
        );
        assert_eq!(super::verifier_verdict(""), "no verifier log");
    }
}
