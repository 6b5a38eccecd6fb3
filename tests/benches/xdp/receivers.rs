//! The peers, each installed on the receiving veth for one measurement and
//! removed by dropping its guard. Netfilter peers run behind an XDP program
//! that passes everything: a veth only accepts XDP_TX frames from its peer
//! when it runs an XDP program itself. The generated frames carry valid IPv4
//! header checksums, so ip_rcv hands them to netfilter.

use std::path::Path;

use anyhow::{Context, Result};
use aya::{
    Ebpf, EbpfLoader,
    maps::Array,
    programs::{Xdp, xdp::XdpMode},
};
use limiter::{
    engine::Engine,
    lab::{Lab, RX_IFACE},
    rules::RuleSet,
    session::Session,
    wire::Mode,
};

use limiter_tests::generator;

/// Every peer holds each source to 1,000 pps with a burst of 100.
pub const RATE: u32 = 1000;
pub const BURST: u32 = 100;
/// State capacity given to every peer (keys, hash entries, set elements).
pub const CAPACITY: u32 = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    XdpDrop,
    Limiter,
    Hashlimit,
    NftMeter,
}

impl Peer {
    pub const ALL: [Peer; 4] = [
        Peer::XdpDrop,
        Peer::Limiter,
        Peer::Hashlimit,
        Peer::NftMeter,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Peer::XdpDrop => "XDP_DROP (floor)",
            Peer::Limiter => "limiter, 500 rules",
            Peer::Hashlimit => "iptables hashlimit",
            Peer::NftMeter => "nftables meter",
        }
    }
}

/// An installed peer; dropping it removes it.
pub enum Installed {
    Xdp {
        _program: Ebpf,
    },
    Limiter(Box<Session>),
    /// A build of the limiter given as an object (a cut of the profile).
    Engine {
        _engine: Box<Engine>,
    },
    Netfilter {
        _pass: Ebpf,
        iptables: bool,
    },
}

/// How the benchmark's own rule limits each source of 198.0.0.0/8.
#[derive(Clone, Copy)]
pub enum Limit {
    /// The peers' limit: 1,000 pps, burst 100.
    Peers,
    /// The peers' limit with key creations unbounded: to fill the table
    /// before a measurement, which then applies [`Limit::Peers`] (the same
    /// rule, so its keys stay).
    PeersFilling,
    /// One packet an hour, with key creations unbounded: after its first
    /// frame every source is over its limit, so a scale run measures the
    /// lookup and the drop of tracked keys, not the stack behind.
    OnePerHour,
}

/// 500 rules: the benchmark's own on 198.0.0.0/8 and 499 others on
/// prefixes of several lengths elsewhere (/16, /24, /32), so the rule
/// tables have a realistic size (the flood's sources, under the /8 alone,
/// take the IPv4 table's first level only).
pub fn rule_file(max_keys: u32, limit: Limit) -> String {
    let (limit, new_keys) = match limit {
        Limit::Peers => (
            format!("{{ rate: {RATE}, unit: second, burst: {BURST} }}"),
            String::new(),
        ),
        Limit::PeersFilling => (
            format!("{{ rate: {RATE}, unit: second, burst: {BURST} }}"),
            "new_keys: { rate: 100000000, unit: second }\n".to_owned(),
        ),
        Limit::OnePerHour => (
            "{ rate: 1, unit: hour, burst: 1 }".to_owned(),
            "new_keys: { rate: 100000000, unit: second }\n".to_owned(),
        ),
    };
    let mut text = format!(
        "max_keys: {max_keys}\n{new_keys}rules:\n  - {{ name: bench, match: {{ source: 198.0.0.0/8 }}, key: source, limit: {limit} }}\n"
    );
    for i in 0..499u32 {
        let (a, b) = (10 + i % 40, i / 40);
        let prefix = match i % 3 {
            0 => format!("{a}.{b}.0.0/16"),
            1 => format!("{a}.{b}.{}.0/24", i % 251),
            _ => format!("{a}.{b}.{}.{}/32", i % 251, i % 199),
        };
        text += &format!(
            "  - {{ name: other-{i}, match: {{ source: {prefix}, protocol: udp, dest_port: {} }}, limit: {{ rate: 50, unit: second }} }}\n",
            1000 + i
        );
    }
    text
}

/// Blocks on addresses no flood uses: the hot path runs with blocks loaded.
pub const BLOCKS: &[&str] = &[
    "203.0.113.0/24",
    "192.0.2.7/32",
    "100.64.0.0/10",
    "2001:db8:dead::/48",
];

pub fn install(lab: &Lab, peer: Peer, max_keys: u32, limit: Limit) -> Result<Installed> {
    match peer {
        Peer::XdpDrop => install_helper(lab, "drop_all", None),
        Peer::Limiter => {
            let rules = RuleSet::parse(&rule_file(max_keys, limit), Path::new("bench.yaml"))?;
            let mut session = lab.rx.enter(|| {
                Session::start(
                    &rules,
                    &[RX_IFACE.to_owned()],
                    Mode::Native,
                    Path::new("/sys/fs/bpf/limiter-bench"),
                )
            })??;
            for block in BLOCKS {
                session.engine_mut().block(block.parse()?, None)?;
            }
            Ok(Installed::Limiter(Box::new(session)))
        }
        Peer::Hashlimit | Peer::NftMeter => {
            let mut pass = Ebpf::load(&generator::object()?)?;
            let prog: &mut Xdp = pass.program_mut("pass").context("pass")?.try_into()?;
            prog.load()?;
            lab.rx.enter(|| prog.attach(RX_IFACE, XdpMode::Driver))??;
            if peer == Peer::Hashlimit {
                lab.rx.exec(
                    "iptables",
                    &[
                        "-t",
                        "raw",
                        "-A",
                        "PREROUTING",
                        "-i",
                        RX_IFACE,
                        "-m",
                        "hashlimit",
                        "--hashlimit-above",
                        &format!("{RATE}/sec"),
                        "--hashlimit-burst",
                        &BURST.to_string(),
                        "--hashlimit-mode",
                        "srcip",
                        "--hashlimit-name",
                        "bench",
                        "--hashlimit-htable-size",
                        "65536",
                        "--hashlimit-htable-max",
                        &CAPACITY.to_string(),
                        "-j",
                        "DROP",
                    ],
                )?;
            } else {
                let ruleset = format!(
                    "table inet bench {{
  set flood {{ type ipv4_addr; size {CAPACITY}; flags dynamic; timeout 10s; }}
  chain prerouting {{
    type filter hook prerouting priority raw; policy accept;
    iifname \"{RX_IFACE}\" update @flood {{ ip saddr limit rate over {RATE}/second burst {BURST} packets }} drop
  }}
}}"
                );
                let path = std::env::temp_dir().join("limiter-bench.nft");
                std::fs::write(&path, ruleset)?;
                lab.rx.exec("nft", &["-f", &path.to_string_lossy()])?;
            }
            Ok(Installed::Netfilter {
                _pass: pass,
                iptables: peer == Peer::Hashlimit,
            })
        }
    }
}

/// The table of `floor_state` and `floor_bucket`: how many 64-byte
/// states (a power of two), and whether a bucket's tags are in the first
/// line of its own states rather than an array of their own.
#[derive(Clone, Copy)]
pub struct FloorTable {
    pub states: u32,
    pub tags_with_states: bool,
}

/// A program of the bench's helper object (`limiter-ebpf/src/flood.rs`)
/// on the receiving veth, with its floor table if it has one.
pub fn install_helper(lab: &Lab, name: &str, table: Option<FloorTable>) -> Result<Installed> {
    let object = generator::object()?;
    let mut loader = EbpfLoader::new();
    if let Some(table) = table {
        loader.map_max_entries("FLOOR_STATES", table.states);
        if !table.tags_with_states {
            loader.map_max_entries("FLOOR_TAGS", (table.states / 8).max(1));
        }
    }
    let mut ebpf = loader.load(&object)?;
    if let Some(table) = table {
        let mut config = Array::<_, u32>::try_from(
            ebpf.map_mut("FLOOR_STATE_MASK")
                .context("FLOOR_STATE_MASK")?,
        )?;
        config.set(0, table.states - 1, 0)?;
        config.set(1, u32::from(table.tags_with_states), 0)?;
    }
    let prog: &mut Xdp = ebpf
        .program_mut(name)
        .context(name.to_owned())?
        .try_into()?;
    prog.load()?;
    lab.rx.enter(|| prog.attach(RX_IFACE, XdpMode::Driver))??;
    Ok(Installed::Xdp { _program: ebpf })
}

/// Where [`install_object`] pins its maps.
pub const OBJECT_PINS: &str = "/sys/fs/bpf/limiter-bench-object";

/// The limiter built as `object` (a cut of the profile) with the bench's
/// rules and blocks, as [`Peer::Limiter`] is installed.
pub fn install_object(lab: &Lab, object: &[u8]) -> Result<Installed> {
    let _ = std::fs::remove_dir_all(OBJECT_PINS);
    let rules = RuleSet::parse(&rule_file(CAPACITY, Limit::Peers), Path::new("bench.yaml"))?;
    let mut engine = Engine::open_object(object, Path::new(OBJECT_PINS), rules.max_keys)?;
    engine.apply(rules)?;
    for block in BLOCKS {
        engine.block(block.parse()?, None)?;
    }
    lab.rx
        .enter(|| engine.attach(RX_IFACE, Mode::Native, false))??;
    Ok(Installed::Engine {
        _engine: Box::new(engine),
    })
}

/// Removes a netfilter peer's rules (the XDP ones go with their guard).
pub fn remove(lab: &Lab, installed: Installed) -> Result<()> {
    if let Installed::Netfilter { iptables, .. } = &installed {
        if *iptables {
            lab.rx
                .exec("iptables", &["-t", "raw", "-F", "PREROUTING"])?;
            lab.rx.exec("iptables", &["-t", "raw", "-X"])?;
        } else {
            lab.rx.exec("nft", &["delete", "table", "inet", "bench"])?;
        }
    }
    let object = matches!(installed, Installed::Engine { .. });
    drop(installed);
    if object {
        let _ = std::fs::remove_dir_all(OBJECT_PINS);
    }
    Ok(())
}
