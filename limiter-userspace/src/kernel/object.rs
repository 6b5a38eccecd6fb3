//! The XDP object: embedded at build time, checked against the state a
//! previous build pinned (map by map, from the object's own ELF), loaded
//! with its maps pinned by name, and its verifier's verdict made readable.

use std::path::Path;

use aya::{
    Ebpf, EbpfLoader,
    maps::{MapError, ProgramArray},
    programs::{ProgramError, Xdp},
};
use limiter_common::{
    abi::map_name,
    keytable::{WAYS, buckets_for, filter_words},
};
use nix::errno::Errno;

use super::KernelError;

/// The XDP object `cargo xtask build` compiled, embedded at build time.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter.bpf.o"));

/// The program's name in the object.
pub const PROGRAM: &str = "limiter";
/// The decision program's, which the entry program tail calls.
pub const DECIDE_PROGRAM: &str = "limiter_decide";
/// The trace program's (`limiter trace`), which the limiter tail calls.
pub const TRACE_PROGRAM: &str = "limiter_trace";
/// The report program's, which the decision program tail calls on a rare
/// event (`kernel::report`).
pub const REPORT_PROGRAM: &str = "limiter_report";

/// Loads `object` with its maps pinned under `pin_dir` (maps already pinned
/// there are reused, state and all), `KEYS` sized for `max_keys` keys, and the
/// program loaded into the kernel (not attached).
pub fn load(object: &[u8], pin_dir: &Path, max_keys: u32) -> Result<Ebpf, KernelError> {
    if object.is_empty() {
        return Err(KernelError::NoObject);
    }
    if let Ok(release) = std::fs::read_to_string("/proc/sys/kernel/osrelease") {
        check_release(release.trim())?;
    }
    // Before reading anything pinned there: pins another user could have
    // placed are not state to adopt.
    super::pins::private_dir(pin_dir)?;
    super::maps::check_pinned(object, pin_dir, max_keys)?;
    let buckets = table_buckets(pin_dir, max_keys);
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(pin_dir)
        .map_max_entries(map_name::KEY_TAGS, buckets)
        .map_max_entries(map_name::KEYS, buckets * WAYS as u32)
        .map_max_entries(map_name::KEY_FILTER, 2 * filter_words(buckets))
        .load(object)
        .map_err(|e| match &e {
            aya::EbpfError::MapError(MapError::CreateError { io_error, .. })
                if io_error.raw_os_error() == Some(Errno::EPERM as i32) =>
            {
                KernelError::NotPermitted
            }
            _ => KernelError::Load(Box::new(e)),
        })?;
    // The entry program tail calls the decision program, which tail
    // calls the report program on a rare event, and they tail call the
    // trace program while someone traces. (An object of a build before
    // the split, as the bench's baseline may be, has none of the maps nor
    // the programs but the trace's.)
    let staged = ebpf.map(map_name::STAGES).is_some();
    let reports = ebpf.map(map_name::REPORT_PROG).is_some();
    let mut wanted = vec![PROGRAM, TRACE_PROGRAM];
    wanted.extend(staged.then_some(DECIDE_PROGRAM));
    wanted.extend(reports.then_some(REPORT_PROGRAM));
    load_programs(&mut ebpf, &wanted)?;
    if staged {
        enter(&mut ebpf, map_name::STAGES, DECIDE_PROGRAM)?;
    }
    if reports {
        enter(&mut ebpf, map_name::REPORT_PROG, REPORT_PROGRAM)?;
    }
    enter(&mut ebpf, map_name::TRACE_PROG, TRACE_PROGRAM)?;
    Ok(ebpf)
}

/// The oldest kernels the program loads on, with what each older one
/// lacks, newest first: a kernel older than the last gets one line naming
/// it, instead of a verifier log that only hints at it.
const NEEDS: [((u32, u32), &str); 1] = [(
    (5, 12),
    "BPF atomic compare-and-exchange (Linux 5.12), which every meter's lock-free update uses",
)];

/// The oldest kernel `cargo xtask test` runs the kernel tests on.
pub const TESTED_SINCE: &str = "6.1";

/// Refuses a kernel release (`uname -r`) older than [`NEEDS`] allows.
pub fn check_release(release: &str) -> Result<(), KernelError> {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    match NEEDS.iter().find(|(since, _)| version < *since) {
        Some((_, lacks)) => Err(KernelError::KernelTooOld {
            release: release.to_owned(),
            lacks,
            tested: TESTED_SINCE,
        }),
        None => Ok(()),
    }
}

/// Puts the loaded program `program` at index 0 of the program array `map`.
fn enter(ebpf: &mut Ebpf, map: &'static str, program: &str) -> Result<(), KernelError> {
    let fd = {
        let loaded: &Xdp = ebpf
            .program(program)
            .and_then(|p| p.try_into().ok())
            .ok_or(KernelError::NoObject)?;
        let fd = loaded
            .fd()
            .map_err(|e| KernelError::Load(Box::new(e.into())))?;
        fd.try_clone()
            .map_err(|e| KernelError::Load(Box::new(ProgramError::from(e).into())))?
    };
    let mut array: ProgramArray<_> = ebpf
        .map_mut(map)
        .ok_or_else(|| KernelError::BadObject(format!("it has no map {map}")))?
        .try_into()
        .map_err(super::maps::map_error(map))?;
    array.set(0, &fd, 0).map_err(super::maps::map_error(map))
}

/// Loads the object's XDP programs `names` into the kernel (not
/// attached), each on a thread of its own: the kernel verifies programs
/// side by side, and the daemon's start is mostly their verification.
fn load_programs(ebpf: &mut Ebpf, names: &[&str]) -> Result<(), KernelError> {
    let mut programs: Vec<(&str, &mut Xdp)> = Vec::new();
    for (name, program) in ebpf.programs_mut() {
        if names.contains(&name) {
            let xdp: &mut Xdp = program.try_into().map_err(|_| KernelError::NoObject)?;
            programs.push((name, xdp));
        }
    }
    if programs.len() != names.len() {
        return Err(KernelError::NoObject);
    }
    std::thread::scope(|scope| {
        let loads: Vec<_> = programs
            .into_iter()
            .map(|(name, program)| scope.spawn(move || load_program(name, program)))
            .collect();
        // The first failure, in the order the object lists the programs.
        loads
            .into_iter()
            .map(|load| {
                load.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect::<Result<Vec<()>, _>>()
            .map(drop)
    })
}

/// Loads one XDP program into the kernel (not attached).
fn load_program(name: &str, program: &mut Xdp) -> Result<(), KernelError> {
    program.load().map_err(|e| match e {
        // EPERM is a missing capability; EACCES and EINVAL are the verifier.
        ProgramError::LoadError { io_error, .. }
            if io_error.raw_os_error() == Some(Errno::EPERM as i32) =>
        {
            KernelError::NotPermitted
        }
        ProgramError::LoadError { verifier_log, .. } => {
            let log = verifier_log.to_string();
            tracing::debug!("verifier log of {name}:\n{log}");
            KernelError::Verifier(verifier_verdict(&log).to_owned())
        }
        other => KernelError::Load(Box::new(aya::EbpfError::ProgramError(other))),
    })
}

/// Buckets of the key table: those of a table pinned under `pin_dir`,
/// whose maps are reused whatever `max_keys` now says (so a map of the
/// table that is new, as the filter is to pins of an older build, is sized
/// to match), or else enough for `max_keys`.
fn table_buckets(pin_dir: &Path, max_keys: u32) -> u32 {
    aya::maps::MapInfo::from_pin(pin_dir.join(map_name::KEYS))
        .map(|info| info.max_entries() / WAYS as u32)
        .unwrap_or_else(|_| buckets_for(max_keys))
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

#[cfg(test)]
mod tests {
    #[test]
    fn kernels_older_than_the_atomics_are_named_and_refused() {
        for release in ["5.10.0-43-cloud-amd64", "4.19.0", "5.11.22"] {
            let error = super::check_release(release).unwrap_err().to_string();
            assert!(
                error.starts_with(&format!("Linux {release} is too old"))
                    && error.contains("compare-and-exchange (Linux 5.12)"),
                "{error}"
            );
        }
        for release in ["5.12.0", "6.1.0-57-cloud-amd64", "6.18.44-fc-v1147", "10.0"] {
            assert!(super::check_release(release).is_ok(), "{release}");
        }
    }

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
