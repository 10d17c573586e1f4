//! World size 1: every collective is a copy (or nothing), so a plain `anneal train` runs the
//! same code path as a distributed one without MPI.

use crate::{
    check_all_to_all, check_gather, check_rank, check_reduce_scatter, Collective, DistError,
    Pending, RecvBuf, SendBuf,
};
use std::cell::RefCell;
use std::collections::VecDeque;

/// The communicator of a process that is the whole job.
#[derive(Debug, Default)]
pub struct Single {
    /// Messages sent to itself, by tag, in order: a `recv` takes the oldest.
    mailbox: RefCell<VecDeque<(u16, Vec<u8>)>>,
}

impl Single {
    /// A world of one.
    pub fn new() -> Self {
        Self::default()
    }
}

/// A completed operation's result.
pub(crate) struct Done(pub(crate) Vec<f32>);

impl Pending for Done {
    fn wait(self: Box<Self>) -> Result<Vec<f32>, DistError> {
        Ok(self.0)
    }
}

/// Copies `send` into `recv` when both hold the same element type and length.
fn copy(op: &'static str, send: SendBuf<'_>, recv: RecvBuf<'_>) -> Result<(), DistError> {
    if send.len() != recv.len() {
        return Err(DistError::Size {
            op,
            what: "receive buffer",
            expected: send.len(),
            got: recv.len(),
        });
    }
    match (send, recv) {
        (SendBuf::F32(s), RecvBuf::F32(r)) => r.copy_from_slice(s),
        (SendBuf::U8(s), RecvBuf::U8(r)) => r.copy_from_slice(s),
        (SendBuf::I64(s), RecvBuf::I64(r)) => r.copy_from_slice(s),
        (s, r) => {
            return Err(DistError::TypeMismatch {
                op,
                send: s.type_name(),
                recv: r.type_name(),
            })
        }
    }
    Ok(())
}

/// The bytes of a buffer in native order (what a self-send queues).
fn to_bytes(buf: SendBuf<'_>) -> Vec<u8> {
    match buf {
        SendBuf::F32(b) => b.iter().flat_map(|v| v.to_ne_bytes()).collect(),
        SendBuf::U8(b) => b.to_vec(),
        SendBuf::I64(b) => b.iter().flat_map(|v| v.to_ne_bytes()).collect(),
    }
}

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<(), DistError> {
        // The sum over one rank is its own buffer.
        Ok(())
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<(), DistError> {
        check_reduce_scatter(send.len(), recv.len(), 1)?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn all_gather(&self, send: SendBuf<'_>, recv: RecvBuf<'_>) -> Result<(), DistError> {
        check_gather(&send, &recv, 1)?;
        copy("all_gather", send, recv)
    }

    fn all_to_all_v(
        &self,
        send: SendBuf<'_>,
        send_counts: &[usize],
        recv: RecvBuf<'_>,
        recv_counts: &[usize],
    ) -> Result<(), DistError> {
        check_all_to_all(&send, send_counts, &recv, recv_counts, 1)?;
        copy("all_to_all_v", send, recv)
    }

    fn broadcast(&self, _buf: &mut [u8], root: usize) -> Result<(), DistError> {
        check_rank("broadcast", root, 1)?;
        Ok(())
    }

    fn barrier(&self) -> Result<(), DistError> {
        Ok(())
    }

    fn send(&self, buf: SendBuf<'_>, dest: usize, tag: u16) -> Result<(), DistError> {
        check_rank("send", dest, 1)?;
        self.mailbox.borrow_mut().push_back((tag, to_bytes(buf)));
        Ok(())
    }

    fn recv(&self, buf: RecvBuf<'_>, src: usize, tag: u16) -> Result<(), DistError> {
        check_rank("recv", src, 1)?;
        let mut mailbox = self.mailbox.borrow_mut();
        let at = mailbox
            .iter()
            .position(|(t, _)| *t == tag)
            .ok_or(DistError::NoMessage { src, tag })?;
        let (_, bytes) = mailbox.remove(at).expect("the position was just found");
        let elem = match &buf {
            RecvBuf::F32(_) => 4,
            RecvBuf::U8(_) => 1,
            RecvBuf::I64(_) => 8,
        };
        if bytes.len() != buf.len() * elem {
            return Err(DistError::Size {
                op: "recv",
                what: "receive buffer (bytes)",
                expected: bytes.len(),
                got: buf.len() * elem,
            });
        }
        match buf {
            RecvBuf::F32(r) => {
                for (v, c) in r.iter_mut().zip(bytes.chunks_exact(4)) {
                    *v = f32::from_ne_bytes(c.try_into().expect("chunks of 4"));
                }
            }
            RecvBuf::U8(r) => r.copy_from_slice(&bytes),
            RecvBuf::I64(r) => {
                for (v, c) in r.iter_mut().zip(bytes.chunks_exact(8)) {
                    *v = i64::from_ne_bytes(c.try_into().expect("chunks of 8"));
                }
            }
        }
        Ok(())
    }

    fn iall_reduce_sum(&self, buf: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        Ok(Box::new(Done(buf)))
    }

    fn ireduce_scatter_sum(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        Ok(Box::new(Done(send)))
    }

    fn iall_gather(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        Ok(Box::new(Done(send)))
    }

    fn split(&self, _color: u32, _key: u32) -> Result<Box<dyn Collective>, DistError> {
        Ok(Box::new(Single::new()))
    }

    fn comm_bytes(&self) -> u64 {
        // Nothing leaves the process.
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_of_one_copies() {
        let c = Single::new();
        let mut x = [1.0f32, 2.0];
        c.all_reduce_sum(&mut x).unwrap();
        assert_eq!(x, [1.0, 2.0]);
        let mut g = [0i64; 2];
        c.all_gather(SendBuf::I64(&[4, 5]), (&mut g[..]).into())
            .unwrap();
        assert_eq!(g, [4, 5]);
        let mut r = [0f32; 1];
        assert!(c.reduce_scatter_sum(&[1.0, 2.0], &mut r).is_err());
        c.send(SendBuf::F32(&[3.5]), 0, 7).unwrap();
        c.recv((&mut r[..]).into(), 0, 7).unwrap();
        assert_eq!(r, [3.5]);
        assert!(matches!(
            c.recv((&mut r[..]).into(), 0, 7),
            Err(DistError::NoMessage { .. })
        ));
        assert!(c.broadcast(&mut [0u8; 2], 1).is_err());
        let sum = c.iall_reduce_sum(vec![1.0, 2.0]).unwrap().wait().unwrap();
        assert_eq!(sum, [1.0, 2.0]);
        assert_eq!(c.comm_bytes(), 0);
    }
}
