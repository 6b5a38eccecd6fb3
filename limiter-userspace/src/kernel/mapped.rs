//! A shared memory mapping of a whole BPF_F_MMAPABLE array map: userspace
//! reads and writes its elements without a system call each, and the
//! kernel sees every write at once (the key table, the IPv4 rule table).

use std::{
    io,
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
};

use aya::maps::{Map, MapData, MapError};

/// The mapping of an array map of `T`.
pub struct Mapped<T> {
    data: MapData,
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the mapping is shared memory the kernel updates at any time;
// through `&self` it is only read (volatile copies) or changed with
// atomics by the owner, and `write` needs `&mut self`.
unsafe impl<T: Send> Send for Mapped<T> {}
unsafe impl<T: Sync> Sync for Mapped<T> {}

impl<T> Mapped<T> {
    /// Maps `map`, which must be an array of `T` created memory-mappable.
    pub fn new(map: Map) -> Result<Self, MapError> {
        let Map::Array(data) = map else {
            // Not an array: pins left by another build (check_pinned says so first).
            return Err(MapError::InvalidMapType { map_type: 0 });
        };
        let info = data.info()?;
        if info.value_size() as usize != size_of::<T>() || !size_of::<T>().is_multiple_of(8) {
            return Err(MapError::InvalidValueSize {
                size: info.value_size() as usize,
                expected: size_of::<T>(),
            });
        }
        let len = info.max_entries() as usize;
        // SAFETY: a shared mapping of the whole array, which the kernel
        // allows for BPF_F_MMAPABLE arrays (elements of a multiple of 8
        // bytes, back to back); unmapped on drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len * size_of::<T>(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                data.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(MapError::SyscallError(aya::sys::SyscallError {
                call: "mmap",
                io_error: io::Error::last_os_error(),
            }));
        }
        Ok(Self {
            data,
            ptr: NonNull::new(ptr.cast()).expect("mmap returned a mapping"),
            len,
        })
    }

    pub fn map(&self) -> &MapData {
        &self.data
    }

    /// Elements in the array.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A pointer to element `index`.
    ///
    /// # Panics
    /// When `index` is out of bounds.
    pub fn at(&self, index: usize) -> *mut T {
        assert!(index < self.len, "{index} is past the array's {}", self.len);
        // SAFETY: in bounds of the mapping.
        unsafe { self.ptr.as_ptr().add(index) }
    }
}

impl<T: Copy> Mapped<T> {
    /// A copy of element `index` (volatile: the kernel may be writing it).
    pub fn get(&self, index: usize) -> T {
        // SAFETY: in bounds, aligned, initialised (a map's memory).
        unsafe { std::ptr::read_volatile(self.at(index)) }
    }

    /// Writes `values` from element `start` on. Only for elements the
    /// kernel does not read meanwhile (an inactive rule generation).
    pub fn write(&mut self, start: usize, values: &[T]) {
        assert!(start + values.len() <= self.len, "write past the array");
        // SAFETY: in bounds; the caller keeps the kernel off these elements.
        unsafe {
            std::ptr::copy_nonoverlapping(values.as_ptr(), self.at(start), values.len());
        }
    }
}

impl<T> Drop for Mapped<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len * size_of::<T>()) };
    }
}
