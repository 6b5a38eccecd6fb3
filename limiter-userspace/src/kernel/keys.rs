//! Reading the whole per-key state map with `BPF_MAP_LOOKUP_BATCH`: one
//! system call per few thousand keys instead of two per key, so a million
//! tracked keys are read in a fraction of a second. (aya 0.14 has no batch
//! API; this is the one system call it lacks.)

use std::{
    io,
    mem::{size_of, zeroed},
    os::fd::{AsFd, AsRawFd},
};

use aya::maps::{IterableMap, MapData};
use limiter_common::abi::{FlowKey, KeyState};

use super::Maps;

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// Keys per system call.
const BATCH: usize = 4096;

/// The part of `union bpf_attr` that batch operations use.
#[repr(C)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Every (key, state) of the map, read in batches.
pub fn dump(maps: &Maps) -> io::Result<Vec<(FlowKey, KeyState)>> {
    let mut out = Vec::new();
    for_each_batch(maps.keys.map(), |keys, values| {
        out.extend(keys.iter().copied().zip(values.iter().copied()))
    })?;
    Ok(out)
}

/// How many keys the map holds, without keeping them (the daemon counts a
/// million-key map every few seconds for its metrics).
pub fn count(maps: &Maps) -> io::Result<usize> {
    let mut n = 0;
    for_each_batch(maps.keys.map(), |keys, _| n += keys.len())?;
    Ok(n)
}

/// Calls `f` with each batch of keys and their states, reusing one buffer.
fn for_each_batch(map: &MapData, mut f: impl FnMut(&[FlowKey], &[KeyState])) -> io::Result<()> {
    let fd = map.fd().as_fd().as_raw_fd();
    let mut keys = vec![FlowKey::default(); BATCH];
    let mut values = vec![KeyState::default(); BATCH];
    // Hash maps use a 4-byte bucket cursor; a key's size is ample room.
    let mut cursor = [0u8; size_of::<FlowKey>()];
    let mut first = true;
    loop {
        // SAFETY: an all-zero bpf_attr is valid.
        let mut attr: BatchAttr = unsafe { zeroed() };
        attr.in_batch = if first { 0 } else { cursor.as_ptr() as u64 };
        attr.out_batch = cursor.as_mut_ptr() as u64;
        attr.keys = keys.as_mut_ptr() as u64;
        attr.values = values.as_mut_ptr() as u64;
        attr.count = BATCH as u32;
        attr.map_fd = fd as u32;
        // SAFETY: attr points at buffers of `count` keys and values, which
        // match the map's key and value sizes.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &mut attr as *mut BatchAttr,
                size_of::<BatchAttr>() as u32,
            )
        };
        let error = (rc != 0).then(io::Error::last_os_error);
        let n = attr.count as usize;
        f(&keys[..n], &values[..n]);
        match error {
            None => first = false,
            // ENOENT: that was the last batch.
            Some(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            Some(e) => return Err(e),
        }
    }
}
