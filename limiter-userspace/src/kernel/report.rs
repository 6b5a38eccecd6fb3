//! The kernel's rare events (a key table with no slot for a new key, a
//! meter update that lost every retry, a first fragment not kept): the
//! report program logs them with aya-log, and a thread of this process
//! drains its records into this process's logs (through `log`, which the
//! `tracing` subscriber forwards).

use std::{
    os::fd::AsFd,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
};

use aya::Ebpf;
use aya_log::EbpfLogger;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

/// How long the drain waits for records before it checks whether the
/// datapath is gone.
const WAKE_MS: u16 = 250;

/// Drains the report program's records while it lives.
pub struct ReportLogs {
    stop: Arc<AtomicBool>,
}

impl ReportLogs {
    /// Starts draining the records of `ebpf`'s report program; `None` for
    /// an object without one (a build before it, as the bench's baseline
    /// may be).
    pub fn start(ebpf: &mut Ebpf) -> Option<Self> {
        let mut logger = match EbpfLogger::init(ebpf) {
            Ok(logger) => logger,
            Err(aya_log::Error::MapNotFound) => return None,
            Err(e) => {
                tracing::warn!("the kernel's rare events will not be logged: {e}");
                return None;
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let spawned = thread::Builder::new()
            .name("kernel-reports".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    let mut fds = [PollFd::new(logger.as_fd(), PollFlags::POLLIN)];
                    // An error (EINTR) only means another look sooner.
                    let _ = poll(&mut fds, PollTimeout::from(WAKE_MS));
                    logger.flush();
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("the kernel's rare events will not be logged: {e}");
            return None;
        }
        Some(Self { stop })
    }
}

impl Drop for ReportLogs {
    fn drop(&mut self) {
        // The thread sees it within `WAKE_MS` and ends; nothing waits.
        self.stop.store(true, Ordering::Relaxed);
    }
}
