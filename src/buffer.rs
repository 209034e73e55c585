//! Which cudarc buffers the calls accept: [`DeviceRead`] and [`DeviceWrite`].
//!
//! Every entry point and view takes `&buffer` for what it reads and `&mut buffer` for what it
//! writes, where the buffer is a [`CudaSlice`], a [`CudaView`] or a [`CudaViewMut`] (write:
//! a `CudaSlice` or a `CudaViewMut`): no `.as_view()` at the call site, and a sub-range is
//! `&slice.slice(a..b)`. The traits are sealed: the crate needs the device address, the byte
//! length, the device and cudarc's stream-ordering guard, which only cudarc's own types
//! provide.

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use crate::validate::Buf;

pub(crate) mod sealed {
    use cudarc::driver::{CudaStream, SyncOnDrop};

    /// What the crate needs from a device buffer, whatever its element type.
    pub trait Buffer {
        /// Length in bytes.
        fn byte_len(&self) -> usize;
        /// Ordinal of the device holding it.
        fn device_ordinal(&self) -> usize;
        /// Device address for reading on `stream`, with cudarc's guard (which, with event
        /// tracking on, records the use when dropped after the launch).
        fn bind_read<'s>(&'s self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>);
    }

    /// A [`Buffer`] that may be written.
    pub trait BufferMut: Buffer {
        /// Device address for writing on `stream`, with cudarc's guard.
        fn bind_write<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>);
        /// The same buffer, read-only.
        fn as_buffer(&self) -> &dyn Buffer;
    }
}

use sealed::{Buffer, BufferMut};

/// A device buffer of `T` that a call may read: `&CudaSlice<T>`, `&CudaView<T>` or
/// `&CudaViewMut<T>` (sealed).
pub trait DeviceRead<T>: Buffer {}

/// A device buffer of `T` that a call may write: `&mut CudaSlice<T>` or `&mut CudaViewMut<T>`
/// (sealed).
pub trait DeviceWrite<T>: DeviceRead<T> + BufferMut {}

macro_rules! debug_dyn {
    ($($ty:ty),*) => {$(
        impl<T> std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                debug_buffer(self, f)
            }
        }
    )*};
}
debug_dyn!(dyn DeviceRead<T> + '_, dyn DeviceWrite<T> + '_);

impl std::fmt::Debug for dyn Buffer + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        debug_buffer(self, f)
    }
}

impl std::fmt::Debug for dyn BufferMut + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        debug_buffer(self, f)
    }
}

fn debug_buffer(b: &(impl Buffer + ?Sized), f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    write!(
        f,
        "DeviceBuffer {{ bytes: {}, device: {} }}",
        b.byte_len(),
        b.device_ordinal()
    )
}

fn ordinal_of<T>(s: &impl DeviceSlice<T>) -> usize {
    s.stream().context().ordinal()
}

macro_rules! readable {
    ($($ty:ty),*) => {$(
        impl<T> Buffer for $ty {
            fn byte_len(&self) -> usize {
                DeviceSlice::num_bytes(self)
            }
            fn device_ordinal(&self) -> usize {
                ordinal_of(self)
            }
            fn bind_read<'s>(&'s self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
                self.device_ptr(stream)
            }
        }
        impl<T> DeviceRead<T> for $ty {}
    )*};
}
readable!(CudaSlice<T>, CudaView<'_, T>, CudaViewMut<'_, T>);

macro_rules! writable {
    ($($ty:ty),*) => {$(
        impl<T> BufferMut for $ty {
            fn bind_write<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
                self.device_ptr_mut(stream)
            }
            fn as_buffer(&self) -> &dyn Buffer {
                self
            }
        }
        impl<T> DeviceWrite<T> for $ty {}
    )*};
}
writable!(CudaSlice<T>, CudaViewMut<'_, T>);

/// A buffer bound to a stream for one launch: its address, its description for validation
/// and cudarc's guard, which must be dropped after the launch.
pub(crate) struct Bound<'s> {
    pub addr: u64,
    pub buf: Buf,
    _guard: SyncOnDrop<'s>,
}

/// Binds `b` for reading on `stream`.
pub(crate) fn read<'s>(b: &'s (impl Buffer + ?Sized), stream: &'s CudaStream) -> Bound<'s> {
    let (addr, guard) = b.bind_read(stream);
    Bound {
        addr,
        buf: Buf {
            addr,
            bytes: b.byte_len(),
            device: b.device_ordinal(),
        },
        _guard: guard,
    }
}

/// Binds `b` for writing on `stream`.
pub(crate) fn write<'s>(b: &'s mut (impl BufferMut + ?Sized), stream: &'s CudaStream) -> Bound<'s> {
    let (bytes, device) = (b.byte_len(), b.device_ordinal());
    let (addr, guard) = b.bind_write(stream);
    Bound {
        addr,
        buf: Buf {
            addr,
            bytes,
            device,
        },
        _guard: guard,
    }
}

/// Binds an optional buffer for reading: `None` gives address 0 (NULL).
pub(crate) fn read_opt<'s>(
    b: Option<&'s (impl Buffer + ?Sized)>,
    stream: &'s CudaStream,
) -> Option<Bound<'s>> {
    b.map(|b| read(b, stream))
}

/// The address of an optional bound buffer (0 = NULL).
pub(crate) fn addr_of(b: &Option<Bound<'_>>) -> u64 {
    b.as_ref().map_or(0, |b| b.addr)
}
