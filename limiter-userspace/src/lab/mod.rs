//! A two-host lab on one machine: namespaces `<name>-tx` and `<name>-rx`
//! joined by a veth pair. The limiter runs on the receiving side; the
//! receiver counts what arrives per source with nftables, independently of
//! the limiter's own counters. Used by `limiter lab` and by the tests.
//!
//! All traffic stays inside these namespaces: frames are addressed to the
//! receiver, from the benchmarking (198.18.0.0/15) and documentation
//! (2001:db8::/32) ranges, and the receiver drops them after counting.

pub mod fleet;
pub mod netns;
pub mod store;
pub mod traffic;

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use anyhow::{Context, Result};
pub use netns::Netns;
pub use traffic::{FloodReport, FloodSource, FrameSocket, Target, flood, udp_frame};

/// Interface names of the first veth pair; pair `n > 0` adds `n` to both.
pub const TX_IFACE: &str = "veth-tx";
pub const RX_IFACE: &str = "veth-rx";

/// The nftables table that counts arrivals in the receiver.
const COUNTER_TABLE: &str = "limiter_lab";

pub struct Lab {
    // Deleting the namespaces removes the veth pairs and any XDP program
    // attached to them.
    pub tx: Netns,
    pub rx: Netns,
    pairs: u8,
}

/// Names of the sending and receiving interface of pair `n`.
pub fn pair_ifaces(n: u8) -> (String, String) {
    if n == 0 {
        (TX_IFACE.to_owned(), RX_IFACE.to_owned())
    } else {
        (format!("{TX_IFACE}{n}"), format!("{RX_IFACE}{n}"))
    }
}

fn pair_macs(n: u8) -> ([u8; 6], [u8; 6]) {
    ([0x02, 0, 0, 0, n, 0x01], [0x02, 0, 0, 0, n, 0x02])
}

impl Lab {
    /// Builds the lab with one veth pair (replacing a leftover of the same name).
    pub fn create(name: &str) -> Result<Self> {
        Self::with_pairs(name, 1)
    }

    /// Builds the lab with `pairs` veth pairs between the two namespaces.
    pub fn with_pairs(name: &str, pairs: u8) -> Result<Self> {
        Self::build(name, pairs, 1)
    }

    /// Builds the lab with one veth pair of `queues` queues each way: a
    /// frame sent on CPU `n` lands in receive queue `n`, whose XDP program
    /// then runs on that same CPU, as on a multi-queue NIC (the benchmark's
    /// flood, one sender per CPU).
    pub fn with_queues(name: &str, queues: u8) -> Result<Self> {
        Self::build(name, 1, queues)
    }

    fn build(name: &str, pairs: u8, queues: u8) -> Result<Self> {
        let queues = queues.max(1).to_string();
        let tx = Netns::create(&format!("{name}-tx"))?;
        let rx = Netns::create(&format!("{name}-rx"))?;
        for n in 0..pairs {
            let (tx_if, rx_if) = pair_ifaces(n);
            let (tx_mac, rx_mac) = pair_macs(n);
            netns::run(
                "ip",
                &[
                    "link",
                    "add",
                    &tx_if,
                    "netns",
                    tx.name(),
                    "address",
                    &mac(tx_mac),
                    "numtxqueues",
                    &queues,
                    "numrxqueues",
                    &queues,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &rx_if,
                    "netns",
                    rx.name(),
                    "address",
                    &mac(rx_mac),
                    "numtxqueues",
                    &queues,
                    "numrxqueues",
                    &queues,
                ],
            )?;
            for (ns, iface, host) in [(&tx, &tx_if, 1), (&rx, &rx_if, 2)] {
                ns.exec(
                    "ip",
                    &[
                        "addr",
                        "add",
                        &format!("198.19.{n}.{host}/24"),
                        "dev",
                        iface,
                    ],
                )?;
                let v6 = format!("2001:db8:ffff:{n}::{host}/64");
                ns.exec("ip", &["addr", "add", &v6, "dev", iface, "nodad"])?;
                ns.exec("ip", &["link", "set", iface, "up"])?;
            }
        }
        let lab = Self { tx, rx, pairs };
        lab.install_counters()?;
        Ok(lab)
    }

    /// Where frames must be addressed to reach the receiver's stack over pair `n`.
    pub fn target(&self, n: u8) -> Target {
        let (src_mac, dst_mac) = pair_macs(n);
        Target {
            src_mac,
            dst_mac,
            v4: Ipv4Addr::new(198, 19, n, 2),
            v6: Ipv6Addr::new(0x2001, 0xdb8, 0xffff, u16::from(n), 0, 0, 0, 2),
        }
    }

    /// Sources flooding at `pps` each with UDP frames of `payload` bytes,
    /// over veth pair `pair`.
    pub fn sources(
        &self,
        pair: u8,
        addrs: &[IpAddr],
        pps: u64,
        payload: usize,
    ) -> Vec<FloodSource> {
        let target = self.target(pair);
        addrs
            .iter()
            .map(|&addr| FloodSource {
                addr,
                frame: udp_frame(&target, addr, payload),
                pps,
            })
            .collect()
    }

    /// A packet socket on the sending side of pair `n`.
    pub fn sender(&self, n: u8) -> Result<FrameSocket> {
        let (tx_if, _) = pair_ifaces(n);
        self.tx
            .enter(|| FrameSocket::open(crate::kernel::if_index(&tx_if)?))?
    }

    /// Counts every frame that reaches a receiving interface's ingress (that
    /// is, what XDP passed) per source address, over all pairs, then drops it.
    fn install_counters(&self) -> Result<()> {
        let mut ruleset = format!(
            "table netdev {COUNTER_TABLE} {{
  set v4 {{ type ipv4_addr; size 65536; flags dynamic; counter; }}
  set v6 {{ type ipv6_addr; size 65536; flags dynamic; counter; }}
"
        );
        for n in 0..self.pairs {
            let (_, rx_if) = pair_ifaces(n);
            ruleset += &format!(
                "  chain ingress{n} {{
    type filter hook ingress device \"{rx_if}\" priority 0; policy accept;
    meta protocol ip update @v4 {{ ip saddr }} drop
    meta protocol ip6 update @v6 {{ ip6 saddr }} drop
  }}
"
            );
        }
        ruleset += "}\n";
        let path = std::env::temp_dir().join(format!("{}.nft", self.rx.name()));
        std::fs::write(&path, ruleset)?;
        let result = self.rx.exec("nft", &["-f", &path.to_string_lossy()]);
        let _ = std::fs::remove_file(&path);
        result.context("installing the receiver's nftables counters (is nftables installed?)")?;
        Ok(())
    }

    /// Packets that arrived at the receiver, per source address.
    pub fn received(&self) -> Result<HashMap<IpAddr, u64>> {
        let mut counts = HashMap::new();
        for set in ["v4", "v6"] {
            let json = self
                .rx
                .exec("nft", &["-j", "list", "set", "netdev", COUNTER_TABLE, set])?;
            let parsed: serde_json::Value =
                serde_json::from_str(&json).context("parsing `nft -j` output")?;
            let items = parsed["nftables"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default();
            // [{"metainfo": ..}, {"set": {"elem": [{"elem": {"val": A, "counter": {"packets": N}}}]}}]
            for elem in items
                .iter()
                .filter_map(|i| i["set"]["elem"].as_array())
                .flatten()
            {
                let elem = &elem["elem"];
                let addr: IpAddr = elem["val"]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .with_context(|| format!("unexpected nft element {elem}"))?;
                let packets = elem["counter"]["packets"]
                    .as_u64()
                    .with_context(|| format!("nft element without a counter: {elem}"))?;
                counts.insert(addr, packets);
            }
        }
        Ok(counts)
    }
}

fn mac(bytes: [u8; 6]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}
