//! The kernel side as userspace drives it: loads the embedded XDP program
//! with its maps pinned by name under a directory (reusing pins that are
//! already there, so state survives restarts), writes rule generations,
//! manages blocks, and attaches the program to interfaces, optionally
//! through pinned links that outlive the process.

use std::{
    ffi::CString,
    io,
    mem::size_of,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, HashMap, LpmTrie, MapData, MapError, MapInfo, PerCpuArray, PerCpuValues,
        lpm_trie::Key,
    },
    programs::{
        ProgramError, Xdp,
        links::{FdLink, LinkError, PinnedLink},
        xdp::{XdpLink, XdpMode},
    },
};
use limiter_common::abi::{
    Block, Candidates, FlowKey, GENERATIONS, GlobalConfig, GlobalCounters, KeyState, MAX_BLOCKS,
    MAX_IFACES, MAX_PREFIXES, MAX_RULES, PrefixKey, RuleConfig, RuleCounters, counter_slot,
    map_name, rule_slot,
};

use crate::tables::Tables;

/// The XDP object `cargo xtask build` compiled, embedded at build time.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter.bpf.o"));

/// The program's name in the object.
pub const PROGRAM: &str = "limiter";

/// Pinned links live here, one file per interface.
pub const LINKS_DIR: &str = "links";

/// Every map with its key size, value size and capacity (`None`: set at
/// load time). Pins found with another layout belong to an incompatible
/// build and are refused rather than misread.
const LAYOUT: [(&str, usize, usize, Option<u32>); 12] = [
    (map_name::CONFIG, 4, size_of::<GlobalConfig>(), Some(1)),
    (
        map_name::RULES,
        4,
        size_of::<RuleConfig>(),
        Some(GENERATIONS * MAX_RULES),
    ),
    (
        map_name::LPM_V4,
        4 + size_of::<PrefixKey<4>>(),
        size_of::<Candidates>(),
        Some(MAX_PREFIXES),
    ),
    (
        map_name::LPM_V6,
        4 + size_of::<PrefixKey<16>>(),
        size_of::<Candidates>(),
        Some(MAX_PREFIXES),
    ),
    (
        map_name::KEYS,
        size_of::<FlowKey>(),
        size_of::<KeyState>(),
        None,
    ),
    (
        map_name::AGGREGATES,
        4,
        size_of::<KeyState>(),
        Some(MAX_RULES),
    ),
    (map_name::BLOCKS_V4, 8, size_of::<Block>(), Some(MAX_BLOCKS)),
    (
        map_name::BLOCKS_V6,
        20,
        size_of::<Block>(),
        Some(MAX_BLOCKS),
    ),
    (map_name::IFACES, 4, 4, Some(MAX_IFACES)),
    (
        map_name::RULE_STATS,
        4,
        size_of::<RuleCounters>(),
        Some(MAX_IFACES * MAX_RULES),
    ),
    (
        map_name::GLOBAL_STATS,
        4,
        size_of::<GlobalCounters>(),
        Some(1),
    ),
    // Listed so that `detach` removes its pin too.
    ("links", 0, 0, None),
];

/// Every map's name.
pub fn map_names() -> impl Iterator<Item = &'static str> {
    LAYOUT.iter().map(|l| l.0).filter(|n| *n != "links")
}

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
    #[error(
        "the state pinned at {dir} was written by an incompatible build ({detail}); \
         `limiter detach --pin-dir {dir}` removes it (and every bucket)"
    )]
    IncompatiblePins { dir: PathBuf, detail: String },
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
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn map_error(name: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    move |source| DatapathError::Map { name, source }
}

/// A loaded limiter program and its (pinned) maps.
pub struct Datapath {
    ebpf: Ebpf,
    pin_dir: PathBuf,
}

/// An interface the program is attached to, and how.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Attachment {
    pub iface: String,
    pub mode: Mode,
    /// The link was pinned by an earlier process and the program replaced on it.
    pub adopted: bool,
}

impl Datapath {
    /// Loads the embedded object with its maps pinned under `pin_dir`:
    /// maps already pinned there are reused, state and all.
    pub fn open(pin_dir: &Path, max_keys: u32) -> Result<Self, DatapathError> {
        Self::open_object(OBJECT, pin_dir, max_keys)
    }

    pub fn open_object(
        object: &[u8],
        pin_dir: &Path,
        max_keys: u32,
    ) -> Result<Self, DatapathError> {
        if object.is_empty() {
            return Err(DatapathError::NoObject);
        }
        check_layout(pin_dir, max_keys)?;
        std::fs::create_dir_all(pin_dir).map_err(|source| DatapathError::Io {
            path: pin_dir.to_owned(),
            source,
        })?;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(pin_dir)
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
        Ok(Self {
            ebpf,
            pin_dir: pin_dir.to_owned(),
        })
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    pub fn config(&self) -> Result<GlobalConfig, DatapathError> {
        let config: Array<_, GlobalConfig> = self.typed(map_name::CONFIG)?;
        config.get(&0, 0).map_err(map_error(map_name::CONFIG))
    }

    pub fn set_config(&mut self, value: GlobalConfig) -> Result<(), DatapathError> {
        let mut config: Array<_, GlobalConfig> = self.typed_mut(map_name::CONFIG)?;
        config.set(0, value, 0).map_err(map_error(map_name::CONFIG))
    }

    /// The named rules of `generation`, by id.
    pub fn rules(&self, generation: u32) -> Result<Vec<(u32, RuleConfig)>, DatapathError> {
        let rules: Array<_, RuleConfig> = self.typed(map_name::RULES)?;
        let mut out = Vec::new();
        for id in 0..MAX_RULES {
            let rule = rules
                .get(&rule_slot(generation, id), 0)
                .map_err(map_error(map_name::RULES))?;
            if rule.name[0] != 0 {
                out.push((id, rule));
            }
        }
        Ok(out)
    }

    /// Rewrites one rule of one generation in place (a single map update,
    /// so packets see the old or the new value, never a mix).
    pub fn set_rule(
        &mut self,
        generation: u32,
        id: u32,
        rule: &RuleConfig,
    ) -> Result<(), DatapathError> {
        let mut rules: Array<_, RuleConfig> = self.typed_mut(map_name::RULES)?;
        rules
            .set(rule_slot(generation, id), rule, 0)
            .map_err(map_error(map_name::RULES))
    }

    /// Empties every table of `generation`.
    pub fn clear_generation(&mut self, generation: u32) -> Result<(), DatapathError> {
        let mut rules: Array<_, RuleConfig> = self.typed_mut(map_name::RULES)?;
        for id in 0..MAX_RULES {
            let slot = rule_slot(generation, id);
            if rules
                .get(&slot, 0)
                .map_err(map_error(map_name::RULES))?
                .name[0]
                != 0
            {
                rules
                    .set(slot, RuleConfig::default(), 0)
                    .map_err(map_error(map_name::RULES))?;
            }
        }
        let generation = (generation & 1) as u8;
        self.remove_prefixes::<4>(map_name::LPM_V4, generation)?;
        self.remove_prefixes::<16>(map_name::LPM_V6, generation)?;
        Ok(())
    }

    /// Removes one generation's entries from the LPM trie `name`.
    fn remove_prefixes<const N: usize>(
        &mut self,
        name: &'static str,
        generation: u8,
    ) -> Result<(), DatapathError>
    where
        PrefixKey<N>: aya::Pod,
    {
        let mut trie: LpmTrie<_, PrefixKey<N>, Candidates> = self.typed_mut(name)?;
        let stale: Vec<_> = trie
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.data().generation == generation)
            .collect();
        for key in stale {
            trie.remove(&key).map_err(map_error(name))?;
        }
        Ok(())
    }

    /// Writes a generation's tables (into an inactive, cleared generation).
    pub fn write_generation(
        &mut self,
        generation: u32,
        tables: &Tables,
    ) -> Result<(), DatapathError> {
        for (id, rule) in &tables.rules {
            self.set_rule(generation, *id, rule)?;
        }
        let mut v4: LpmTrie<_, PrefixKey<4>, Candidates> = self.typed_mut(map_name::LPM_V4)?;
        for (prefix, key, candidates) in &tables.v4 {
            v4.insert(&Key::new(*prefix, *key), candidates, 0)
                .map_err(map_error(map_name::LPM_V4))?;
        }
        let mut v6: LpmTrie<_, PrefixKey<16>, Candidates> = self.typed_mut(map_name::LPM_V6)?;
        for (prefix, key, candidates) in &tables.v6 {
            v6.insert(&Key::new(*prefix, *key), candidates, 0)
                .map_err(map_error(map_name::LPM_V6))?;
        }
        Ok(())
    }

    /// Zeroes a rule id's aggregate state and counters before the id is
    /// given to a new rule.
    pub fn reset_rule_state(&mut self, id: u32) -> Result<(), DatapathError> {
        let mut aggregates: Array<_, KeyState> = self.typed_mut(map_name::AGGREGATES)?;
        aggregates
            .set(id, KeyState::default(), 0)
            .map_err(map_error(map_name::AGGREGATES))?;
        let cpus = aya::util::nr_cpus().map_err(|(_, source)| DatapathError::Io {
            path: "/sys/devices/system/cpu/possible".into(),
            source,
        })?;
        let mut stats: PerCpuArray<_, RuleCounters> = self.typed_mut(map_name::RULE_STATS)?;
        for iface in 0..MAX_IFACES {
            let zeros =
                PerCpuValues::try_from(vec![RuleCounters::default(); cpus]).map_err(|source| {
                    DatapathError::Io {
                        path: "/sys/devices/system/cpu/possible".into(),
                        source,
                    }
                })?;
            stats
                .set(counter_slot(iface, id), zeros, 0)
                .map_err(map_error(map_name::RULE_STATS))?;
        }
        Ok(())
    }

    /// Deletes every key of the given rule ids; returns how many.
    pub fn forget_keys(&mut self, ids: &[u32]) -> Result<usize, DatapathError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let mut keys: HashMap<_, FlowKey, KeyState> = self.typed_mut(map_name::KEYS)?;
        let doomed: Vec<FlowKey> = keys
            .keys()
            .filter_map(Result::ok)
            .filter(|k| ids.contains(&k.rule))
            .collect();
        for key in &doomed {
            // Already evicted by the LRU is fine.
            let _ = keys.remove(key);
        }
        Ok(doomed.len())
    }

    /// Inserts or replaces a block of `prefix_len` bits of `addr`.
    pub fn set_block<const N: usize>(
        &mut self,
        addr: [u8; N],
        prefix_len: u32,
        expires_ns: u64,
    ) -> Result<(), DatapathError> {
        let name = block_map(N);
        let mut blocks: LpmTrie<_, [u8; N], Block> = self.typed_mut(name)?;
        let key = Key::new(prefix_len, addr);
        let dropped = blocks.get(&key, 0).map(|b| b.dropped_packets).unwrap_or(0);
        blocks
            .insert(
                &key,
                Block {
                    expires_ns,
                    dropped_packets: dropped,
                },
                0,
            )
            .map_err(map_error(name))
    }

    /// Removes a block; `false` if there was none.
    pub fn remove_block<const N: usize>(
        &mut self,
        addr: [u8; N],
        prefix_len: u32,
    ) -> Result<bool, DatapathError> {
        let name = block_map(N);
        let mut blocks: LpmTrie<_, [u8; N], Block> = self.typed_mut(name)?;
        match blocks.remove(&Key::new(prefix_len, addr)) {
            Ok(()) => Ok(true),
            Err(MapError::KeyNotFound) => Ok(false),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(false)
            }
            Err(e) => Err(map_error(name)(e)),
        }
    }

    /// Every block of one family: (address, prefix length, state).
    pub fn blocks<const N: usize>(&self) -> Result<Vec<([u8; N], u32, Block)>, DatapathError> {
        let name = block_map(N);
        let blocks: LpmTrie<_, [u8; N], Block> = self.typed(name)?;
        blocks
            .iter()
            .map(|entry| entry.map(|(k, v)| (k.data(), k.prefix_len(), v)))
            .collect::<Result<_, _>>()
            .map_err(map_error(name))
    }

    /// The counter slot of interface `ifindex`, registering it if new.
    fn iface_slot(&mut self, ifindex: u32) -> Result<u32, DatapathError> {
        let mut ifaces: HashMap<_, u32, u32> = self.typed_mut(map_name::IFACES)?;
        if let Ok(slot) = ifaces.get(&ifindex, 0) {
            return Ok(slot);
        }
        let used: Vec<u32> = ifaces
            .iter()
            .filter_map(Result::ok)
            .map(|(_, slot)| slot)
            .collect();
        let slot = (1..MAX_IFACES)
            .find(|s| !used.contains(s))
            .ok_or(DatapathError::TooManyInterfaces)?;
        ifaces
            .insert(ifindex, slot, 0)
            .map_err(map_error(map_name::IFACES))?;
        Ok(slot)
    }

    /// Registered interfaces: (ifindex, counter slot).
    pub fn iface_slots(&self) -> Result<Vec<(u32, u32)>, DatapathError> {
        let ifaces: HashMap<_, u32, u32> = self.typed(map_name::IFACES)?;
        ifaces
            .iter()
            .collect::<Result<_, _>>()
            .map_err(map_error(map_name::IFACES))
    }

    /// Attaches to `iface`; `auto` falls back from native to skb mode.
    ///
    /// With `pin_link`, the link is pinned under `<pin dir>/links/<iface>`
    /// and outlives this process; a link already pinned there is adopted:
    /// this program replaces the old one on it atomically, so the interface
    /// is never without a limiter.
    pub fn attach(
        &mut self,
        iface: &str,
        mode: Mode,
        pin_link: bool,
    ) -> Result<Attachment, DatapathError> {
        let ifindex = if_index(iface)?;
        self.iface_slot(ifindex)?;
        let link_path = self.pin_dir.join(LINKS_DIR).join(iface);
        if pin_link && link_path.exists() {
            return self.adopt(iface, &link_path);
        }
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
                Ok(id) => {
                    if pin_link {
                        let link = self.program_mut().take_link(id).map_err(|source| {
                            DatapathError::Attach {
                                iface: iface.to_owned(),
                                mode: attempt,
                                source,
                            }
                        })?;
                        pin(link, &link_path)?;
                    }
                    return Ok(Attachment {
                        iface: iface.to_owned(),
                        mode: attempt,
                        adopted: false,
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

    fn adopt(&mut self, iface: &str, path: &Path) -> Result<Attachment, DatapathError> {
        let adopt_error = |detail: String| DatapathError::Adopt {
            path: path.to_owned(),
            detail,
        };
        let pinned = PinnedLink::from_pin(path).map_err(|e| adopt_error(e.to_string()))?;
        let link = XdpLink::try_from(FdLink::from(pinned))
            .map_err(|e: LinkError| adopt_error(e.to_string()))?;
        let id = self
            .program_mut()
            .attach_to_link(link)
            .map_err(|e| adopt_error(e.to_string()))?;
        // The pin keeps the link; the program must not hold (and on drop
        // close) it as one of its own.
        drop(
            self.program_mut()
                .take_link(id)
                .map_err(|e| adopt_error(e.to_string()))?,
        );
        Ok(Attachment {
            iface: iface.to_owned(),
            mode: Mode::Auto,
            adopted: true,
        })
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

    fn typed<'a, T>(&'a self, name: &'static str) -> Result<T, DatapathError>
    where
        T: TryFrom<&'a aya::maps::Map, Error = MapError>,
    {
        T::try_from(self.map(name)?).map_err(map_error(name))
    }

    fn typed_mut<'a, T>(&'a mut self, name: &'static str) -> Result<T, DatapathError>
    where
        T: TryFrom<&'a mut aya::maps::Map, Error = MapError>,
    {
        let map = self.ebpf.map_mut(name).ok_or(DatapathError::NoObject)?;
        T::try_from(map).map_err(map_error(name))
    }
}

fn block_map(addr_len: usize) -> &'static str {
    if addr_len == 4 {
        map_name::BLOCKS_V4
    } else {
        map_name::BLOCKS_V6
    }
}

fn pin(link: XdpLink, path: &Path) -> Result<(), DatapathError> {
    let io_error = |source| DatapathError::Io {
        path: path.to_owned(),
        source,
    };
    std::fs::create_dir_all(path.parent().expect("a links dir")).map_err(io_error)?;
    let fd_link = FdLink::try_from(link).map_err(|e| DatapathError::Adopt {
        path: path.to_owned(),
        detail: format!("the kernel gave no bpf_link to pin ({e}); Linux 5.9 or newer is needed"),
    })?;
    fd_link.pin(path).map_err(|e| DatapathError::Adopt {
        path: path.to_owned(),
        detail: e.to_string(),
    })?;
    Ok(())
}

/// Refuses pins whose layout differs from this build's.
fn check_layout(pin_dir: &Path, max_keys: u32) -> Result<(), DatapathError> {
    for (name, key_size, value_size, entries) in LAYOUT {
        let path = pin_dir.join(name);
        if key_size == 0 || !path.exists() {
            continue;
        }
        let info = MapInfo::from_pin(&path).map_err(map_error(name))?;
        let mismatch = |what: &str, pinned: u32, ours: usize| DatapathError::IncompatiblePins {
            dir: pin_dir.to_owned(),
            detail: format!("{name}: {what} is {pinned}, this build uses {ours}"),
        };
        if info.key_size() as usize != key_size {
            return Err(mismatch("key size", info.key_size(), key_size));
        }
        if info.value_size() as usize != value_size {
            return Err(mismatch("value size", info.value_size(), value_size));
        }
        match entries {
            Some(n) if info.max_entries() != n => {
                return Err(mismatch("capacity", info.max_entries(), n as usize));
            }
            None if info.max_entries() != max_keys => tracing::warn!(
                "{name} keeps its capacity of {} keys (asked for {max_keys}); `limiter detach` first to change it",
                info.max_entries()
            ),
            _ => {}
        }
    }
    Ok(())
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

/// Unpins every link under `pin_dir` (which detaches the program from its
/// interface once nothing else holds the link) and removes every pin.
/// Returns the interfaces detached.
pub fn detach_all(pin_dir: &Path) -> Result<Vec<String>, DatapathError> {
    let links = pin_dir.join(LINKS_DIR);
    let mut detached = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&links) {
        for entry in entries.flatten() {
            let path = entry.path();
            let pinned = PinnedLink::from_pin(&path).map_err(|e| DatapathError::Adopt {
                path: path.clone(),
                detail: e.to_string(),
            })?;
            let link = pinned.unpin().map_err(|source| DatapathError::Io {
                path: path.clone(),
                source,
            })?;
            drop(link);
            detached.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    match std::fs::remove_dir_all(pin_dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(DatapathError::Io {
                path: pin_dir.to_owned(),
                source: e,
            });
        }
        _ => {}
    }
    detached.sort();
    Ok(detached)
}

/// Opens one pinned map (for readers such as `limiter stats`).
pub fn open_pinned(pin_dir: &Path, name: &str) -> Result<MapData, MapError> {
    MapData::from_pin(pin_dir.join(name))
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
