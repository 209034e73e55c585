//! Which cudarc buffers the calls accept.
//!
//! - Argument-struct fields and call parameters take `&buf` for what they read and
//!   `&mut buf` for what they write: [`DeviceRead`] is implemented by [`CudaSlice`],
//!   [`CudaView`] and [`CudaViewMut`], [`DeviceWrite`] by `CudaSlice` and `CudaViewMut`. No
//!   `.as_view()` at the call site; a sub-range is `&slice.slice(a..b)`.
//! - View constructors ([`Query`](crate::Query), [`Output`](crate::Output), ...) take the same
//!   references, or a cudarc view **by value** ([`IntoDeviceRead`], [`IntoDeviceWrite`]):
//!   `Query::strided(buf.slice(off..), strides)` can be returned from a helper function.
//!
//! The traits are sealed: the crate needs the device address, the byte length, the device
//! and cudarc's stream-ordering guard, which cudarc's own types provide.

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use crate::validate::Buf;

pub(crate) mod sealed {
    use cudarc::driver::{CudaView, CudaViewMut};

    /// A buffer of `T` that can be read: a view of it.
    pub trait Read<T> {
        fn view(&self) -> CudaView<'_, T>;
    }

    /// A buffer of `T` that can be written: a mutable view of it, as `T` or as bytes.
    pub trait Write<T> {
        fn view_mut(&mut self) -> CudaViewMut<'_, T>;
        fn bytes_mut(&mut self) -> CudaViewMut<'_, u8>;
    }

    /// Conversion into a view that lives as long as the borrow it came from.
    pub trait IntoView<'a, T> {
        fn into_view(self) -> CudaView<'a, T>;
    }

    /// Conversion into a mutable view that lives as long as the borrow it came from.
    pub trait IntoViewMut<'a, T> {
        fn into_view_mut(self) -> CudaViewMut<'a, T>;
    }

    /// Element types of which every bit pattern is a value.
    pub trait AnyBits {
        /// The 16-bit float type it is, for the cache views' element check.
        const HALF: Option<crate::types::DType> = None;
    }
}

/// An element type of which every bit pattern is a valid value: the integers, `f32`, `f64`,
/// [`half::f16`] and [`half::bf16`] (sealed). A cache buffer the crate writes raw bytes into
/// ([`KvCacheMut`](crate::KvCacheMut)) must hold one of these, so that reading it back as
/// its own type afterwards is sound (a `bool` buffer, for one, would then hold invalid values).
pub trait AnyBitPattern: sealed::AnyBits {}

macro_rules! any_bit_pattern {
    ($($t:ty),*) => {$(
        impl sealed::AnyBits for $t {}
        impl AnyBitPattern for $t {}
    )*};
}
any_bit_pattern!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64);
impl sealed::AnyBits for half::f16 {
    const HALF: Option<crate::types::DType> = Some(crate::types::DType::F16);
}
impl AnyBitPattern for half::f16 {}
impl sealed::AnyBits for half::bf16 {
    const HALF: Option<crate::types::DType> = Some(crate::types::DType::Bf16);
}
impl AnyBitPattern for half::bf16 {}

/// The 16-bit float type `E` is (`None` for bytes and the other types).
pub(crate) const fn half_of<E: AnyBitPattern>() -> Option<crate::types::DType> {
    <E as sealed::AnyBits>::HALF
}

/// A device buffer of `T` that a call may read: a [`CudaSlice<T>`], [`CudaView<T>`] or
/// [`CudaViewMut<T>`], passed as `&buf` (sealed). `Sync`, so that the argument structs
/// holding `&dyn DeviceRead<T>` fields are `Send` and `Sync`.
pub trait DeviceRead<T>: sealed::Read<T> + Sync {}

/// A device buffer of `T` that a call may write: a [`CudaSlice<T>`] or [`CudaViewMut<T>`],
/// passed as `&mut buf` (sealed).
pub trait DeviceWrite<T>: DeviceRead<T> + sealed::Write<T> {}

/// What a view constructor accepts for a buffer it reads: `&buf` for any [`DeviceRead`]
/// buffer, or a [`CudaView`] by value (e.g. `buf.slice(a..b)`) (sealed).
pub trait IntoDeviceRead<'a, T>: sealed::IntoView<'a, T> {}

/// What a view constructor accepts for a buffer it writes: `&mut buf` for any
/// [`DeviceWrite`] buffer, or a [`CudaViewMut`] by value (e.g. `buf.slice_mut(a..b)`)
/// (sealed).
pub trait IntoDeviceWrite<'a, T>: sealed::IntoViewMut<'a, T> {}

impl<T> sealed::Read<T> for CudaSlice<T> {
    fn view(&self) -> CudaView<'_, T> {
        self.as_view()
    }
}
impl<T> sealed::Read<T> for CudaView<'_, T> {
    fn view(&self) -> CudaView<'_, T> {
        self.slice(..)
    }
}
impl<T> sealed::Read<T> for CudaViewMut<'_, T> {
    fn view(&self) -> CudaView<'_, T> {
        self.as_view()
    }
}
impl<T> DeviceRead<T> for CudaSlice<T> {}
impl<T: Sync> DeviceRead<T> for CudaView<'_, T> {}
impl<T: Sync> DeviceRead<T> for CudaViewMut<'_, T> {}

impl<T> sealed::Write<T> for CudaSlice<T> {
    fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.as_view_mut()
    }
    fn bytes_mut(&mut self) -> CudaViewMut<'_, u8> {
        let bytes = self.num_bytes();
        // SAFETY: every byte pattern is a valid u8; the view covers exactly the slice.
        unsafe { self.transmute_mut::<u8>(bytes) }.expect("a slice holds its own bytes")
    }
}
impl<T> sealed::Write<T> for CudaViewMut<'_, T> {
    fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice_mut(..)
    }
    fn bytes_mut(&mut self) -> CudaViewMut<'_, u8> {
        let bytes = DeviceSlice::num_bytes(self);
        // SAFETY: as above.
        unsafe { self.transmute_mut::<u8>(bytes) }.expect("a view holds its own bytes")
    }
}
impl<T> DeviceWrite<T> for CudaSlice<T> {}
impl<T: Sync> DeviceWrite<T> for CudaViewMut<'_, T> {}

impl<'a, T, B: DeviceRead<T> + ?Sized> sealed::IntoView<'a, T> for &'a B {
    fn into_view(self) -> CudaView<'a, T> {
        self.view()
    }
}
impl<'a, T> sealed::IntoView<'a, T> for CudaView<'a, T> {
    fn into_view(self) -> CudaView<'a, T> {
        self
    }
}
impl<'a, T, B: DeviceRead<T> + ?Sized> IntoDeviceRead<'a, T> for &'a B {}
impl<'a, T> IntoDeviceRead<'a, T> for CudaView<'a, T> {}

impl<'a, T, B: DeviceWrite<T> + ?Sized> sealed::IntoViewMut<'a, T> for &'a mut B {
    fn into_view_mut(self) -> CudaViewMut<'a, T> {
        self.view_mut()
    }
}
impl<'a, T> sealed::IntoViewMut<'a, T> for CudaViewMut<'a, T> {
    fn into_view_mut(self) -> CudaViewMut<'a, T> {
        self
    }
}
impl<'a, T, B: DeviceWrite<T> + ?Sized> IntoDeviceWrite<'a, T> for &'a mut B {}
impl<'a, T> IntoDeviceWrite<'a, T> for CudaViewMut<'a, T> {}

impl<T> std::fmt::Debug for dyn DeviceRead<T> + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = sealed::Read::view(self);
        write!(
            f,
            "DeviceRead {{ bytes: {}, device: {} }}",
            v.num_bytes(),
            ordinal_of(&v)
        )
    }
}

/// A view of `b` (a `&dyn DeviceRead` field of an argument struct).
pub(crate) fn view_of<T>(b: &(impl DeviceRead<T> + ?Sized)) -> CudaView<'_, T> {
    sealed::Read::view(b)
}

/// A view of `b`, or `None`.
pub(crate) fn view_of_opt<'a, T>(b: Option<&'a dyn DeviceRead<T>>) -> Option<CudaView<'a, T>> {
    b.map(|b| sealed::Read::view(b))
}

/// A mutable view of `b`.
pub(crate) fn view_mut_of<T>(b: &mut (impl DeviceWrite<T> + ?Sized)) -> CudaViewMut<'_, T> {
    sealed::Write::view_mut(b)
}

fn ordinal_of<T>(s: &impl DeviceSlice<T>) -> usize {
    s.stream().context().ordinal()
}

/// A buffer bound to a stream for one launch: its address, its description for validation
/// and cudarc's guard, which must be dropped after the launch.
pub(crate) struct Bound<'s> {
    pub addr: u64,
    pub buf: Buf,
    _guard: SyncOnDrop<'s>,
}

/// Binds `v` for reading on `stream`.
pub(crate) fn read<'s, T>(v: &'s CudaView<'_, T>, stream: &'s CudaStream) -> Bound<'s> {
    let (addr, guard) = v.device_ptr(stream);
    Bound {
        addr,
        buf: Buf {
            addr,
            bytes: v.num_bytes(),
            device: ordinal_of(v),
        },
        _guard: guard,
    }
}

/// Binds an optional view for reading: `None` stays `None` (address 0, NULL).
pub(crate) fn read_opt<'s, T>(
    v: &'s Option<CudaView<'_, T>>,
    stream: &'s CudaStream,
) -> Option<Bound<'s>> {
    v.as_ref().map(|v| read(v, stream))
}

/// Binds `v` for writing on `stream`.
pub(crate) fn write<'s, T>(v: &'s mut CudaViewMut<'_, T>, stream: &'s CudaStream) -> Bound<'s> {
    let (bytes, device) = (v.num_bytes(), ordinal_of(v));
    let (addr, guard) = v.device_ptr_mut(stream);
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

/// The address of an optional bound buffer (0 = NULL).
pub(crate) fn addr_of(b: &Option<Bound<'_>>) -> u64 {
    b.as_ref().map_or(0, |b| b.addr)
}
