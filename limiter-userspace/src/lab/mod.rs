//! A two-host lab on one machine: namespaces `<name>-tx` and `<name>-rx`
//! joined by a veth pair. The limiter runs on the receiving side; the
//! receiver counts what arrives per source with nftables, independently of
//! the limiter's own counters. Used by `limiter lab` and by the tests.
//!
//! All traffic stays inside these namespaces: frames are addressed to the
//! receiver, from the benchmarking (198.18.0.0/15) and documentation
//! (2001:db8::/32) ranges, and the receiver drops them after counting.

pub mod netns;
pub mod traffic;

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use anyhow::{Context, Result};
pub use netns::Netns;
pub use traffic::{FloodReport, FloodSource, FrameSocket, Target, flood, udp_frame};

/// Interface names inside the namespaces.
pub const TX_IFACE: &str = "veth-tx";
pub const RX_IFACE: &str = "veth-rx";
/// The receiver's addresses.
pub const RX_V4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 2);
pub const RX_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 2);
const TX_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const RX_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

/// The nftables table that counts arrivals in the receiver.
const COUNTER_TABLE: &str = "limiter_lab";

pub struct Lab {
    // Namespaces go last: deleting them removes the veth pair and any XDP
    // program attached to it.
    pub tx: Netns,
    pub rx: Netns,
}

impl Lab {
    /// Builds the lab (replacing a leftover one of the same name).
    pub fn create(name: &str) -> Result<Self> {
        let tx = Netns::create(&format!("{name}-tx"))?;
        let rx = Netns::create(&format!("{name}-rx"))?;
        netns::run(
            "ip",
            &[
                "link",
                "add",
                TX_IFACE,
                "netns",
                tx.name(),
                "address",
                &mac(TX_MAC),
                "type",
                "veth",
                "peer",
                "name",
                RX_IFACE,
                "netns",
                rx.name(),
                "address",
                &mac(RX_MAC),
            ],
        )?;
        for (ns, iface, v4, v6) in [
            (&tx, TX_IFACE, "198.19.0.1/24", "2001:db8:ffff::1/64"),
            (&rx, RX_IFACE, "198.19.0.2/24", "2001:db8:ffff::2/64"),
        ] {
            ns.exec("ip", &["addr", "add", v4, "dev", iface])?;
            ns.exec("ip", &["addr", "add", v6, "dev", iface, "nodad"])?;
            ns.exec("ip", &["link", "set", iface, "up"])?;
        }
        let lab = Self { tx, rx };
        lab.install_counters()?;
        Ok(lab)
    }

    /// Where frames must be addressed to reach the receiver's stack.
    pub fn target(&self) -> Target {
        Target {
            src_mac: TX_MAC,
            dst_mac: RX_MAC,
            v4: RX_V4,
            v6: RX_V6,
        }
    }

    /// A packet socket on the sending side of the veth pair.
    pub fn sender(&self) -> Result<FrameSocket> {
        self.tx
            .enter(|| FrameSocket::open(crate::datapath::if_index(TX_IFACE)?))?
    }

    /// Counts every frame that reaches the receiver's ingress (that is, what
    /// XDP passed) per source address, then drops it.
    fn install_counters(&self) -> Result<()> {
        let ruleset = format!(
            "table netdev {COUNTER_TABLE} {{
  set v4 {{ type ipv4_addr; size 65536; flags dynamic; counter; }}
  set v6 {{ type ipv6_addr; size 65536; flags dynamic; counter; }}
  chain ingress {{
    type filter hook ingress device \"{RX_IFACE}\" priority 0; policy accept;
    meta protocol ip update @v4 {{ ip saddr }} drop
    meta protocol ip6 update @v6 {{ ip6 saddr }} drop
  }}
}}"
        );
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
