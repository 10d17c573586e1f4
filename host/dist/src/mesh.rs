//! The device mesh: the job's ranks laid out along its parallel dimensions, row-major in the
//! order of [`MeshDim::ALL`] (`tp` varies fastest, so a tensor-parallel group is on
//! consecutive ranks, which a launcher puts on one machine).
//!
//! Expert parallelism is not a dimension of its own in the world: as in TorchTitan, `ep` borrows
//! the ranks of `dp_shard` (it must divide it). `dp_shard`'s coordinate `s` splits into an expert
//! coordinate `s % ep` (the inner part: an expert group is `ep` consecutive shard ranks) and an
//! expert-FSDP coordinate `s / ep` (`efsdp = dp_shard / ep`), see [`Mesh::expert_comms`].
//! Under context parallelism the `cp` ranks of a shard group train on the same sequences, so an
//! expert group stays within one `cp` coordinate (its tokens are that coordinate's chunks) and
//! the expert-FSDP group spans `efsdp × cp` ranks, as dense parameters shard over
//! `dp_shard × cp`.

use crate::{Collective, DistError};

/// The config keys of the mesh degrees, in [`MeshDim::ALL`] order (`[parallelism]`).
pub const MESH_KEYS: [&str; 6] = ["pp", "dp_replicate", "dp_shard", "cp", "ep", "tp"];

/// One parallel dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MeshDim {
    /// Pipeline stages.
    Pp,
    /// Data-parallel replicas (DDP, and the replicate dimension of HSDP).
    DpReplicate,
    /// Data-parallel shards (FSDP).
    DpShard,
    /// Context (sequence) parallelism.
    Cp,
    /// Expert parallelism.
    Ep,
    /// Tensor parallelism.
    Tp,
}

impl MeshDim {
    /// Every dimension, outermost first.
    pub const ALL: [MeshDim; 6] = [
        MeshDim::Pp,
        MeshDim::DpReplicate,
        MeshDim::DpShard,
        MeshDim::Cp,
        MeshDim::Ep,
        MeshDim::Tp,
    ];

    /// Its key in `[parallelism]`.
    pub fn key(self) -> &'static str {
        MESH_KEYS[self as usize]
    }
}

/// Why a mesh does not fit the job.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MeshError {
    /// A degree is neither positive nor -1.
    #[error("parallelism.{key} = {degree}: a degree must be at least 1, or -1 for the rest of the world size")]
    BadDegree {
        /// The key.
        key: &'static str,
        /// Its value.
        degree: i64,
    },
    /// More than one degree is -1.
    #[error("parallelism.{first} and parallelism.{second} are both -1; at most one degree may take the rest of the world size")]
    TwoWildcards {
        /// The first -1 key.
        first: &'static str,
        /// The second.
        second: &'static str,
    },
    /// The degrees do not multiply to the world size.
    #[error("parallelism: {product_text} = {product}, but the job has {world} process(es); make the degrees multiply to {world}{hint}")]
    WorldSize {
        /// `dp_replicate (2) × dp_shard (1) × ...`.
        product_text: String,
        /// The product of the fixed degrees.
        product: usize,
        /// Processes in the job.
        world: usize,
        /// What a -1 would need, when there is one.
        hint: String,
    },
    /// `ep` does not divide `dp_shard` (or is -1).
    #[error("parallelism.ep = {ep} must divide parallelism.dp_shard = {dp_shard}: expert parallelism borrows the ranks of dp_shard (it is not an extra dimension of the world)")]
    EpNotDividing {
        /// The `ep` degree as configured.
        ep: i64,
        /// The resolved `dp_shard` degree.
        dp_shard: usize,
    },
}

/// The communicators of expert parallelism: the expert group and the expert-FSDP group
/// ([`Mesh::expert_comms`]).
pub type ExpertComms = (Box<dyn Collective>, Box<dyn Collective>);

/// The job's mesh: a degree per dimension (multiplying to the world size) and this rank's
/// coordinates.
#[derive(Clone, Debug, PartialEq)]
pub struct Mesh {
    /// The world's degrees (the `ep` slot is 1: it is no dimension of the world).
    degrees: [usize; 6],
    coords: [usize; 6],
    /// The expert-parallel degree, borrowed from `dp_shard`.
    ep: usize,
}

impl Mesh {
    /// The mesh of a job of `world` processes, seen from `rank`, from the config's degrees in
    /// [`MeshDim::ALL`] order (one may be -1: the world size over the others' product). `ep`
    /// takes no part in the product: it must divide the resolved `dp_shard`.
    pub fn new(degrees: [i64; 6], world: usize, rank: usize) -> Result<Mesh, MeshError> {
        let ep = degrees[MeshDim::Ep as usize];
        let mut degrees = degrees;
        degrees[MeshDim::Ep as usize] = 1;
        let mut mesh = Mesh::world_mesh(degrees, world, rank)?;
        let dp_shard = mesh.degree(MeshDim::DpShard);
        match usize::try_from(ep) {
            Ok(e) if e >= 1 && dp_shard.is_multiple_of(e) => mesh.ep = e,
            _ => return Err(MeshError::EpNotDividing { ep, dp_shard }),
        }
        Ok(mesh)
    }

    /// [`Mesh::new`] without `ep` (its slot is 1).
    fn world_mesh(degrees: [i64; 6], world: usize, rank: usize) -> Result<Mesh, MeshError> {
        let mut wildcard: Option<usize> = None;
        for (i, &d) in degrees.iter().enumerate() {
            if d == -1 {
                if let Some(first) = wildcard {
                    return Err(MeshError::TwoWildcards {
                        first: MESH_KEYS[first],
                        second: MESH_KEYS[i],
                    });
                }
                wildcard = Some(i);
            } else if d < 1 {
                return Err(MeshError::BadDegree {
                    key: MESH_KEYS[i],
                    degree: d,
                });
            }
        }
        let fixed: usize = degrees
            .iter()
            .filter(|&&d| d > 0)
            .map(|&d| d as usize)
            .product();
        let mut resolved = [1usize; 6];
        for (r, &d) in resolved.iter_mut().zip(&degrees) {
            *r = d.max(1) as usize;
        }
        let fits = match wildcard {
            Some(i) if fixed > 0 && world.is_multiple_of(fixed) => {
                resolved[i] = world / fixed;
                true
            }
            Some(_) => false,
            None => fixed == world,
        };
        if !fits {
            let product_text = MeshDim::ALL
                .iter()
                .zip(&degrees)
                .filter(|(_, &d)| d != -1)
                .map(|(dim, d)| format!("{} ({d})", dim.key()))
                .collect::<Vec<_>>()
                .join(" × ");
            let hint = match wildcard {
                Some(i) => format!(
                    " (parallelism.{} = -1 takes the rest, so the others must divide {world})",
                    MESH_KEYS[i]
                ),
                None => String::new(),
            };
            return Err(MeshError::WorldSize {
                product_text,
                product: fixed,
                world,
                hint,
            });
        }
        let mut coords = [0usize; 6];
        let mut rest = rank;
        for i in (0..6).rev() {
            coords[i] = rest % resolved[i];
            rest /= resolved[i];
        }
        Ok(Mesh {
            degrees: resolved,
            coords,
            ep: 1,
        })
    }

    /// The degree of `dim` (`ep`: the expert-parallel degree, borrowed from `dp_shard`).
    pub fn degree(&self, dim: MeshDim) -> usize {
        match dim {
            MeshDim::Ep => self.ep,
            _ => self.degrees[dim as usize],
        }
    }

    /// This rank's coordinate along `dim` (`ep`: its place in its expert group, the inner part
    /// of its `dp_shard` coordinate).
    pub fn coord(&self, dim: MeshDim) -> usize {
        match dim {
            MeshDim::Ep => self.coords[MeshDim::DpShard as usize] % self.ep,
            _ => self.coords[dim as usize],
        }
    }

    /// Processes in the mesh (`ep` borrows ranks and adds none).
    pub fn world_size(&self) -> usize {
        self.degrees.iter().product()
    }

    /// The expert communicators of an `ep > 1` mesh: the expert group (the `ep` consecutive
    /// `dp_shard` ranks of one `cp` coordinate that split the experts between them, ordered by
    /// expert coordinate) and the expert-FSDP group (the `dp_shard / ep` × `cp` ranks that hold
    /// the same experts, ordered by their `dp_shard` then `cp` coordinate). Collective over
    /// `world`.
    pub fn expert_comms(&self, world: &dyn Collective) -> Result<ExpertComms, DistError> {
        let (shard, cp) = (MeshDim::DpShard as usize, MeshDim::Cp as usize);
        // Every coordinate but those in `skip`, linear: ranks in different places of the
        // other dimensions never share a group.
        let base = |skip: &[usize]| {
            (0..6)
                .filter(|i| !skip.contains(i))
                .fold(0usize, |b, i| b * self.degrees[i] + self.coords[i])
        };
        let s = self.coords[shard];
        let groups = self.degrees[shard] / self.ep;
        let id = |v: usize| {
            u32::try_from(v).map_err(|_| DistError::TooLarge {
                op: "mesh split",
                count: v,
            })
        };
        let ep = world.split(id(base(&[shard]) * groups + s / self.ep)?, id(s % self.ep)?)?;
        let efsdp = world.split(
            id(base(&[shard, cp]) * self.ep + s % self.ep)?,
            id(s / self.ep * self.degrees[cp] + self.coords[cp])?,
        )?;
        Ok((ep, efsdp))
    }

    /// The communicator of `dim`: the ranks that share every other coordinate with this one,
    /// ordered by their coordinate along `dim`. Collective over `world`: every rank must ask
    /// for the same dimensions in the same order.
    pub fn comm(
        &self,
        world: &dyn Collective,
        dim: MeshDim,
    ) -> Result<Box<dyn Collective>, DistError> {
        self.comm_of(world, &[dim])
    }

    /// The communicator of several dimensions together (`dp_replicate` and `dp_shard`: every
    /// data-parallel rank): the ranks that share every coordinate outside `dims`, ordered
    /// row-major by their coordinates along `dims`. Collective over `world`.
    pub fn comm_of(
        &self,
        world: &dyn Collective,
        dims: &[MeshDim],
    ) -> Result<Box<dyn Collective>, DistError> {
        let inside = |i: usize| dims.iter().any(|d| *d as usize == i);
        // The color is this rank's linear index with the coordinates inside `dims` set to 0;
        // the key is its linear index within `dims`.
        let (mut color, mut key) = (0usize, 0usize);
        for i in 0..6 {
            if inside(i) {
                key = key * self.degrees[i] + self.coords[i];
                color *= self.degrees[i];
            } else {
                color = color * self.degrees[i] + self.coords[i];
            }
        }
        let too_large = |count| DistError::TooLarge {
            op: "mesh split",
            count,
        };
        let color = u32::try_from(color).map_err(|_| too_large(color))?;
        let key = u32::try_from(key).map_err(|_| too_large(key))?;
        world.split(color, key)
    }

    /// `dp_replicate = 2, dp_shard = 1, ...`: the resolved degrees, for logs.
    pub fn describe(&self) -> String {
        MeshDim::ALL
            .iter()
            .map(|d| format!("{} = {}", d.key(), self.degree(*d)))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn degrees_resolve_against_the_world() {
        // pp, dp_replicate, dp_shard, cp, ep, tp
        let m = Mesh::new([1, 2, -1, 1, 1, 1], 4, 3).unwrap();
        assert_eq!(m.degree(MeshDim::DpShard), 2);
        assert_eq!(
            (m.coord(MeshDim::DpReplicate), m.coord(MeshDim::DpShard)),
            (1, 1)
        );
        let m = Mesh::new([1, 1, 1, 1, 1, 2], 2, 1).unwrap();
        assert_eq!(m.coord(MeshDim::Tp), 1);
        // ep borrows dp_shard's ranks: 4 processes, dp_shard 4 (the rest), ep 2.
        let m = Mesh::new([1, 1, -1, 1, 2, 1], 4, 3).unwrap();
        assert_eq!(m.world_size(), 4);
        assert_eq!((m.degree(MeshDim::DpShard), m.degree(MeshDim::Ep)), (4, 2));
        assert_eq!(m.coord(MeshDim::Ep), 1);
        let e = Mesh::new([1, 1, 2, 1, 4, 1], 2, 0).unwrap_err().to_string();
        assert!(
            e.contains("parallelism.ep = 4") && e.contains("parallelism.dp_shard = 2"),
            "{e}"
        );
        assert!(Mesh::new([1, 1, 2, 1, -1, 1], 2, 0).is_err());
        let e = Mesh::new([1, 2, 1, 1, 1, 1], 3, 0).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("dp_replicate (2)") && text.contains("3 process"),
            "{text}"
        );
        let e = Mesh::new([1, 2, -1, 1, 1, 1], 3, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("parallelism.dp_shard = -1"), "{e}");
        assert!(matches!(
            Mesh::new([1, -1, -1, 1, 1, 1], 4, 0),
            Err(MeshError::TwoWildcards { .. })
        ));
        assert!(matches!(
            Mesh::new([0, 1, 1, 1, 1, 1], 1, 0),
            Err(MeshError::BadDegree { key: "pp", .. })
        ));
    }
}
