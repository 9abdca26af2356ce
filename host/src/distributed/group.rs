//! A safe handle on MLX's distributed group (`mlx/c/distributed_group.h`)
//! and the collectives tensor parallelism needs (`mlx/c/distributed.h`).
//!
//! The ring backend reads its peers from the environment, as
//! `mlx.launch` sets it: `MLX_RANK` (this process's rank) and
//! `MLX_HOSTFILE` (a JSON list, one entry per rank, each a list of
//! `"ip:port"` addresses that rank listens on). [`Group::init`] blocks
//! until every rank has connected.

use std::ffi::CString;

use mlx_rs::{error::Exception, Array, StreamOrDevice};

use super::DistributedError;

/// A communication group of ranks (MLX's `mlx::core::distributed::Group`).
///
/// Collectives built with it are lazy array ops: they run when the graph
/// that holds them is evaluated, and every rank must evaluate the same
/// collectives in the same order (a mismatch pairs unrelated buffers).
#[derive(Debug)]
pub struct Group {
    raw: mlx_sys::mlx_distributed_group,
    rank: usize,
    size: usize,
}

// SAFETY: the handle is a pointer to an immutable MLX group object shared by
// reference count in C++; MLX itself uses the same group from its
// evaluation threads.
unsafe impl Send for Group {}
// SAFETY: as above; the handle is never mutated after `init`.
unsafe impl Sync for Group {}

impl Group {
    /// Initializes the distributed backend `backend` (`"ring"`, `"mpi"`,
    /// `"nccl"`, `"jaccl"`; `"any"` lets MLX choose) from the environment
    /// and returns the world group.
    ///
    /// Errors: [`DistributedError::Backend`] when this libmlx lacks the
    /// backend or the group cannot form (a peer unreachable, a malformed
    /// hostfile); MLX's message is included.
    pub fn init(backend: &str) -> Result<Self, DistributedError> {
        let bk = CString::new(backend).map_err(|_| DistributedError::Backend {
            backend: backend.into(),
            reason: "the name contains a NUL byte".into(),
        })?;
        // SAFETY: `bk` outlives both calls; `raw` is an out-parameter
        // the call fills (or leaves empty on failure).
        let available = unsafe { mlx_sys::mlx_distributed_is_available(bk.as_ptr()) };
        if !available {
            return Err(DistributedError::Backend {
                backend: backend.into(),
                reason: "this libmlx build does not provide it".into(),
            });
        }
        let mut raw = unsafe { mlx_sys::mlx_distributed_group_new() };
        // strict: fail instead of falling back to a group of one.
        let status = unsafe { mlx_sys::mlx_distributed_init(&mut raw, true, bk.as_ptr()) };
        if status != 0 || raw.ctx.is_null() {
            return Err(DistributedError::Backend {
                backend: backend.into(),
                reason: "the group did not form (check MLX_RANK, MLX_HOSTFILE and that every \
                         rank is running)"
                    .into(),
            });
        }
        // SAFETY: `raw` is a valid group now.
        let (rank, size) = unsafe {
            (
                mlx_sys::mlx_distributed_group_rank(raw),
                mlx_sys::mlx_distributed_group_size(raw),
            )
        };
        Ok(Group {
            raw,
            rank: rank.max(0) as usize,
            size: size.max(1) as usize,
        })
    }

    /// This process's rank, `0..size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Lazy element-wise sum of `x` over every rank (same shape and dtype
    /// on each); the result has `x`'s shape.
    ///
    /// Errors: MLX refuses the op (e.g. an unsupported dtype).
    pub fn all_sum(&self, x: &Array) -> Result<Array, Exception> {
        self.collective(x, "all_sum", |res, x, g, s| unsafe {
            mlx_sys::mlx_distributed_all_sum(res, x, g, s)
        })
    }

    /// Lazy concatenation of every rank's `x` along axis 0, in rank order
    /// (`[size * n, ...]` for `x: [n, ...]`).
    ///
    /// Errors: MLX refuses the op.
    pub fn all_gather(&self, x: &Array) -> Result<Array, Exception> {
        self.collective(x, "all_gather", |res, x, g, s| unsafe {
            mlx_sys::mlx_distributed_all_gather(res, x, g, s)
        })
    }

    fn collective(
        &self,
        x: &Array,
        name: &str,
        op: impl FnOnce(
            *mut mlx_sys::mlx_array,
            mlx_sys::mlx_array,
            mlx_sys::mlx_distributed_group,
            mlx_sys::mlx_stream,
        ) -> i32,
    ) -> Result<Array, Exception> {
        let stream = StreamOrDevice::default();
        // SAFETY: `res` is a fresh handle the op fills, wrapped right after
        // (freed on drop); `x`, the group and the stream outlive the call.
        unsafe {
            let mut res = mlx_sys::mlx_array_new();
            let status = op(&mut res, x.as_ptr(), self.raw, stream.as_ref().as_ptr());
            let out = Array::from_ptr(res);
            if status != 0 {
                return Err(Exception::custom(format!(
                    "distributed {name}: MLX refused the op"
                )));
            }
            Ok(out)
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `mlx_distributed_init` and is freed once.
        unsafe {
            mlx_sys::mlx_distributed_group_free(self.raw);
        }
    }
}
