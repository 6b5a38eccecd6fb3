//! The capabilities a limiter keeps once its program is loaded and its
//! listeners are bound: only what the rest of its life needs, so a flaw in
//! the control socket, the metrics endpoint or the rule parser cannot be
//! turned into the rest of root's powers.

use caps::{CapSet, Capability, CapsHashSet, errors::CapsError};

/// What a running limiter needs: CAP_BPF and CAP_PERFMON for the program
/// and its maps (the verifier gives a program with pointer-carrying maps
/// CAP_PERFMON's checks), CAP_NET_ADMIN to attach and detach XDP links, and
/// CAP_SYS_RESOURCE for the locked-memory limit of kernels that charge maps
/// to it. `dist/limiter.service` bounds the service to the same set.
pub const NEEDED: [Capability; 4] = [
    Capability::CAP_BPF,
    Capability::CAP_NET_ADMIN,
    Capability::CAP_PERFMON,
    Capability::CAP_SYS_RESOURCE,
];

/// Drops every capability but [`NEEDED`] from the effective, permitted,
/// inheritable and ambient sets, and from the bounding set when allowed (so
/// nothing it runs regains them). Returns what it kept.
pub fn keep_only_needed() -> Result<CapsHashSet, CapsError> {
    let permitted = caps::read(None, CapSet::Permitted)?;
    let keep: CapsHashSet = NEEDED
        .into_iter()
        .filter(|c| permitted.contains(c))
        .collect();
    // The bounding set needs CAP_SETPCAP, which a service unit may already
    // have taken away (then its bounding set is the unit's).
    if caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP)? {
        for cap in caps::all() {
            if !keep.contains(&cap) && caps::has_cap(None, CapSet::Bounding, cap)? {
                caps::drop(None, CapSet::Bounding, cap)?;
            }
        }
    }
    caps::clear(None, CapSet::Ambient)?;
    caps::clear(None, CapSet::Inheritable)?;
    caps::set(None, CapSet::Effective, &keep)?;
    caps::set(None, CapSet::Permitted, &keep)?;
    Ok(keep)
}
