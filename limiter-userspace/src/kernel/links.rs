//! Attaching the program to interfaces: native (driver) or skb mode, and
//! links pinned under `<pin dir>/links/<interface>` that outlive the
//! process; adopting such a link (the program replaced on it atomically)
//! and detaching everything.

use std::{io, path::Path};

use aya::programs::{
    links::{FdLink, LinkError, PinnedLink},
    xdp::{XdpLink, XdpMode},
};
use limiter_common::abi::{MAX_IFACES, MAX_IFINDEX, map_name};

use super::{Datapath, KernelError, maps::map_error};
use crate::wire::{Attachment, Mode};

/// Pinned links live here, one file per interface.
pub const LINKS_DIR: &str = "links";

impl Datapath {
    /// The counter slot of interface `ifindex`, registering it if new;
    /// slot 0 (shared) for an index beyond `MAX_IFINDEX`.
    fn iface_slot(&mut self, ifindex: u32) -> Result<u32, KernelError> {
        if ifindex >= MAX_IFINDEX {
            return Ok(0);
        }
        let used = self.maps.iface_slots()?;
        if let Some(&(_, slot)) = used.iter().find(|(i, _)| *i == ifindex) {
            return Ok(slot);
        }
        let slot = (1..MAX_IFACES)
            .find(|s| !used.iter().any(|(_, used)| used == s))
            .ok_or(KernelError::TooManyInterfaces)?;
        self.maps
            .ifaces
            .set(ifindex, slot, 0)
            .map_err(map_error(map_name::IFACES))?;
        Ok(slot)
    }

    /// Tells the program `iface`'s MTU (in its counter slot), by which it
    /// charges a buffer longer than any frame (skb mode: GSO, GRO) the
    /// frames it carries.
    fn set_mtu(&mut self, iface: &str, slot: u32) -> Result<(), KernelError> {
        let mtu = super::offloads::mtu(iface).map_err(|source| KernelError::Io {
            path: format!("the MTU of {iface}").into(),
            source,
        })?;
        if let Some(map) = self.maps.iface_mtu.as_mut() {
            map.set(slot, mtu, 0)
                .map_err(map_error(map_name::IFACE_MTU))?;
        }
        Ok(())
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
    ) -> Result<Attachment, KernelError> {
        let ifindex = if_index(iface)?;
        let slot = self.iface_slot(ifindex)?;
        self.set_mtu(iface, slot)?;
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
                            KernelError::Attach {
                                iface: iface.to_owned(),
                                mode: attempt,
                                source,
                            }
                        })?;
                        pin(link, &link_path)?;
                        self.held.link(&link_path)?;
                    }
                    if attempt == Mode::Skb {
                        skb_mode_without_merging(iface, mode == Mode::Auto);
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
                    last = Some(KernelError::Attach {
                        iface: iface.to_owned(),
                        mode: attempt,
                        source,
                    });
                }
            }
        }
        Err(last.expect("at least one attempt"))
    }

    fn adopt(&mut self, iface: &str, path: &Path) -> Result<Attachment, KernelError> {
        let adopt_error = |detail: String| KernelError::Adopt {
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
        // The pin keeps the link, and so does the daemon's own reference
        // (should the pin go); the program must not hold (and on drop
        // close) it as one of its own.
        drop(
            self.program_mut()
                .take_link(id)
                .map_err(|e| adopt_error(e.to_string()))?,
        );
        self.held.link(path)?;
        // The mode the link was made in, as the kernel says.
        let mode = super::netlink::xdp_mode(if_index(iface)?)
            .ok()
            .flatten()
            .unwrap_or(Mode::Auto);
        if mode == Mode::Skb {
            skb_mode_without_merging(iface, false);
        }
        Ok(Attachment {
            iface: iface.to_owned(),
            mode,
            adopted: true,
        })
    }
}

/// In skb (generic) mode the program runs after GRO: a buffer GRO merged
/// from many frames would be one packet to a packet limit. So GRO and LRO
/// go off on the interface, and the operator is told, as of a fallback
/// from `auto` (slower than native, and not what was asked for).
fn skb_mode_without_merging(iface: &str, fell_back: bool) {
    if fell_back {
        tracing::warn!(
            event = "skb_mode_fallback",
            iface,
            "{iface}: attached in skb (generic) mode, native XDP failed: slower than native, and packets are seen after the stack's receive offloads (`--mode native` makes this an error; `limiter stats` and limiter_xdp_attached show the mode)"
        );
    }
    match super::offloads::stop_merging(iface) {
        Ok(before) if before.any() => tracing::warn!(
            event = "offloads_off",
            iface,
            "{iface}: turned {} off: in skb mode the program would see what it merged as one packet (`ethtool -K {iface} {} on` after `limiter detach` restores it)",
            before.names().join(" and "),
            before.names().join(" on ")
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(
            event = "offloads_on",
            iface,
            "{iface}: could not turn GRO and LRO off ({e}): packet limits there count a merged packet once"
        ),
    }
}

fn pin(link: XdpLink, path: &Path) -> Result<(), KernelError> {
    super::pins::private_dir(path.parent().expect("a links dir"))?;
    let fd_link = FdLink::try_from(link).map_err(|e| KernelError::Adopt {
        path: path.to_owned(),
        detail: format!("the kernel gave no bpf_link to pin ({e}); Linux 5.9 or newer is needed"),
    })?;
    fd_link.pin(path).map_err(|e| KernelError::Adopt {
        path: path.to_owned(),
        detail: e.to_string(),
    })?;
    Ok(())
}

/// The index of `iface` in the calling thread's network namespace.
pub fn if_index(iface: &str) -> Result<u32, KernelError> {
    nix::net::if_::if_nametoindex(iface).map_err(|_| KernelError::NoInterface(iface.to_owned()))
}

/// Unpins every link under `pin_dir` (which detaches the program from its
/// interface once nothing else holds the link) and removes every pin.
/// Returns the interfaces detached.
pub fn detach_all(pin_dir: &Path) -> Result<Vec<String>, KernelError> {
    let links = pin_dir.join(LINKS_DIR);
    let mut detached = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&links) {
        for entry in entries.flatten() {
            let path = entry.path();
            let pinned = PinnedLink::from_pin(&path).map_err(|e| KernelError::Adopt {
                path: path.clone(),
                detail: e.to_string(),
            })?;
            let link = pinned.unpin().map_err(|source| KernelError::Io {
                path: path.clone(),
                source,
            })?;
            drop(link);
            detached.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    match std::fs::remove_dir_all(pin_dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(KernelError::Io {
                path: pin_dir.to_owned(),
                source: e,
            });
        }
        _ => {}
    }
    detached.sort();
    Ok(detached)
}
