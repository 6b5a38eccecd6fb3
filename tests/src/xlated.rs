//! A loaded program as the kernel rewrote it (its "xlated" instructions,
//! read with BPF_OBJ_GET_INFO_BY_FD): what the verifier made of each
//! call. A map look-up whose map the verifier cannot tell (the compiler
//! merged two look-ups into one call) is left to the generic helper, an
//! indirect call per packet, where an array's look-up is otherwise a few
//! inlined instructions and a trie's a direct call.

use std::{
    io,
    os::fd::{FromRawFd, OwnedFd},
};

const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
/// `BPF_JMP | BPF_CALL`.
const CALL: u8 = 0x85;

fn bpf(cmd: libc::c_long, attr: &mut [u8]) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a writable buffer of the size passed, laid out as
    // the command's `union bpf_attr` member.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            attr.len() as libc::c_uint,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// The translated instructions of program `id` (root only).
pub fn instructions(id: u32) -> io::Result<Vec<[u8; 8]>> {
    let mut attr = [0u8; 16];
    attr[..4].copy_from_slice(&id.to_ne_bytes());
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)? as i32;
    // SAFETY: a descriptor the kernel just returned, owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // `struct bpf_prog_info`: xlated_prog_len at 20, xlated_prog_insns at 32.
    let info = |buffer: Option<&mut Vec<[u8; 8]>>| -> io::Result<u32> {
        let mut info = [0u8; 256];
        if let Some(buffer) = buffer {
            let bytes = (buffer.len() * 8) as u32;
            info[20..24].copy_from_slice(&bytes.to_ne_bytes());
            info[32..40].copy_from_slice(&(buffer.as_mut_ptr() as u64).to_ne_bytes());
        }
        let mut attr = [0u8; 16];
        attr[..4].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&fd) as u32).to_ne_bytes());
        attr[4..8].copy_from_slice(&(info.len() as u32).to_ne_bytes());
        attr[8..16].copy_from_slice(&(info.as_mut_ptr() as u64).to_ne_bytes());
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
        Ok(u32::from_ne_bytes(info[20..24].try_into().unwrap()))
    };
    let len = info(None)?;
    let mut insns = vec![[0u8; 8]; len as usize / 8];
    info(Some(&mut insns))?;
    Ok(insns)
}

/// Kernel symbols' addresses, from one read of /proc/kallsyms.
fn kernel_symbols<const N: usize>(names: [&str; N]) -> io::Result<[u64; N]> {
    let table = std::fs::read_to_string("/proc/kallsyms")?;
    let mut found = [None; N];
    for line in table.lines() {
        let mut fields = line.split_whitespace();
        let (Some(address), Some(_kind), Some(name)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if let Some(i) = names.iter().position(|n| *n == name)
            && found[i].is_none()
        {
            found[i] = u64::from_str_radix(address, 16).ok();
        }
    }
    let mut addresses = [0; N];
    for (i, name) in names.iter().enumerate() {
        addresses[i] =
            found[i].ok_or_else(|| io::Error::other(format!("{name} is not in /proc/kallsyms")))?;
        if addresses[i] == 0 {
            return Err(io::Error::other(
                "/proc/kallsyms hides addresses (kernel.kptr_restrict): run as root",
            ));
        }
    }
    Ok(addresses)
}

/// The translated immediate of a call of the generic `bpf_map_lookup_elem`
/// helper: the function's address less `__bpf_call_base`'s.
pub fn generic_map_lookup_call() -> io::Result<i32> {
    let [helper, base] = kernel_symbols(["bpf_map_lookup_elem", "__bpf_call_base"])?;
    Ok(helper.wrapping_sub(base) as i64 as i32)
}

/// How many calls of program `id` have the translated immediate `imm`
/// ([`generic_map_lookup_call`]).
pub fn calls_to(id: u32, imm: i32) -> io::Result<usize> {
    Ok(instructions(id)?
        .iter()
        .filter(|insn| {
            insn[0] == CALL
                && insn[1] >> 4 == 0
                && i32::from_ne_bytes(insn[4..8].try_into().unwrap()) == imm
        })
        .count())
}
