//! Memory per tracked key, as the kernel itself accounts it: the limiter's
//! key table from its maps' fdinfo (`memlock`, allocated whole when the
//! table is created, divided by its capacity in keys); iptables hashlimit from /proc/slabinfo (its own
//! `xt_hashlimit` cache: slab pages per live entry) plus its bucket array;
//! the nftables set from the growth of the kernel's slab memory
//! (/proc/meminfo `Slab`) while it fills, per element.

use std::{
    fs,
    os::fd::{AsFd, AsRawFd},
    path::Path,
};

use anyhow::{Context, Result};
use aya::maps::MapData;

/// Bytes per key of the key table pinned in `pins` (`KEYS`, the slots, and
/// `KEY_TAGS`, their tags), from the maps' fdinfo: both maps' memory over
/// the slots.
pub fn limiter_bytes_per_key(pins: &Path) -> Result<f64> {
    let fdinfo = |name: &str| -> Result<(f64, f64)> {
        let path = pins.join(name);
        let map =
            MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
        let info = fs::read_to_string(format!(
            "/proc/self/fdinfo/{}",
            map.fd().as_fd().as_raw_fd()
        ))?;
        let field = |field: &str| -> Result<f64> {
            info.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().parse().ok())
                .with_context(|| format!("no {field} in the fdinfo of {name}"))
        };
        Ok((field("memlock:")?, field("max_entries:")?))
    };
    let (slots_bytes, slots) = fdinfo("KEYS")?;
    let (tags_bytes, _) = fdinfo("KEY_TAGS")?;
    let (filter_bytes, _) = fdinfo("KEY_FILTER")?;
    Ok((slots_bytes + tags_bytes + filter_bytes) / slots)
}

/// (live objects, bytes of slab pages) of a slab cache.
pub fn slab(cache: &str) -> Result<(u64, u64)> {
    let text = fs::read_to_string("/proc/slabinfo")?;
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(cache))
        .with_context(|| format!("no slab cache {cache}"))?;
    // name active num objsize objperslab pagesperslab : tunables ... : slabdata active_slabs num_slabs ...
    let fields: Vec<&str> = line.split_whitespace().collect();
    let num =
        |i: usize| -> Result<u64> { Ok(fields.get(i).context("short slabinfo line")?.parse()?) };
    let pages_per_slab = num(5)?;
    let slabdata = fields
        .iter()
        .position(|f| *f == "slabdata")
        .context("no slabdata")?;
    let num_slabs = num(slabdata + 2)?;
    Ok((num(1)?, num_slabs * pages_per_slab * 4096))
}

/// The kernel's slab memory in bytes (/proc/meminfo `Slab`).
pub fn slab_total() -> Result<u64> {
    let text = fs::read_to_string("/proc/meminfo")?;
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("Slab:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no Slab in /proc/meminfo")?;
    Ok(kb * 1024)
}
