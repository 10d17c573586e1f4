//! Encoded conversations served as batches: one conversation per row, padded to the row's
//! length, or (`pack`) as many whole conversations per row as fit, each at positions from 0 so
//! that attention stays within it ([`Batch::positions`]). Either way no token attends across
//! conversations. Each row's images are read and processed when its batch is made,
//! concatenated row by row.

use std::sync::Arc;

use rayon::prelude::*;

use super::encode::EncodedChat;
use crate::image::{load_image_with_limit, ImageProcessor, DEFAULT_MAX_PIXELS};
use crate::loader::{Batch, EpochOrder, LoaderState, IGNORE_INDEX};
use crate::{DataError, Result};

/// How rows are cut and filled.
#[derive(Clone, Debug)]
pub struct RowShape {
    /// Tokens per row.
    pub seq_len: usize,
    /// The id padding a short row (its targets take no loss).
    pub pad_id: u32,
    /// The model's image processor (`None` for a text-only model).
    pub processor: Option<ImageProcessor>,
    /// Pack several whole conversations into a row (positions restarting at each, attention
    /// within each), instead of one conversation per row.
    pub pack: bool,
}

impl RowShape {
    /// How many tokens of `doc` a row holds: at most `seq_len + 1` (inputs and the last
    /// target), cut before an image whose placeholders would not fit whole.
    fn kept(&self, doc: &EncodedChat) -> usize {
        let mut n = doc.tokens.len().min(self.seq_len + 1);
        if let Some(&(start, _)) = doc
            .image_spans
            .iter()
            .find(|&&(start, len)| start + len > self.seq_len)
        {
            n = n.min(start + 1);
        }
        n
    }

    /// Whether a row of `doc` has at least one target that takes a loss.
    pub fn trains_on(&self, doc: &EncodedChat) -> bool {
        doc.trained[1..self.kept(doc).max(1)].iter().any(|&t| t)
    }

    /// Whether `doc` is cut to fit a row.
    pub fn cuts(&self, doc: &EncodedChat) -> bool {
        self.kept(doc) < doc.tokens.len()
    }

    /// Input slots `doc` takes in a row: its kept tokens but the last (a target only).
    fn slots(&self, doc: &EncodedChat) -> usize {
        self.kept(doc).saturating_sub(1)
    }

    /// Appends `doc` to the row `b` is filling (which has `used` of its slots filled): its
    /// inputs, targets (the assistant's tokens only), positions from 0 when packing, and its
    /// images, processed. Returns the slots it took.
    fn push_doc(&self, b: &mut Batch, doc: &EncodedChat, row_images: &mut usize) -> Result<usize> {
        let n = self.kept(doc);
        let slots = n.saturating_sub(1);
        b.inputs
            .extend(doc.tokens[..slots].iter().map(|&id| i64::from(id)));
        for j in 1..n {
            b.targets.push(match doc.trained[j] {
                true => i64::from(doc.tokens[j]),
                false => IGNORE_INDEX,
            });
        }
        if self.pack {
            b.positions.extend(0..slots as i64);
        }
        let kept = doc
            .image_spans
            .iter()
            .take_while(|&&(start, len)| start + len < n)
            .count();
        if kept > 0 {
            let processor = self
                .processor
                .as_ref()
                .ok_or_else(|| DataError::InvalidArgument {
                    name: "images",
                    message: "a conversation with images for a model without an image processor"
                        .into(),
                })?;
            let images: Vec<_> = doc.images[..kept]
                .par_iter()
                .map(|p| Ok(processor.process(&load_image_with_limit(p, DEFAULT_MAX_PIXELS)?)?))
                .collect::<Result<_>>()?;
            b.images.extend(images);
            *row_images += kept;
        }
        Ok(slots)
    }

    /// Ends the row `b` is filling, `used` slots of it filled: pads the rest (padding takes no
    /// loss; when packing it is a run of its own, so no document attends to it) and records the
    /// row's image count.
    fn end_row(&self, b: &mut Batch, used: usize, row_images: usize) {
        let pad = self.seq_len - used;
        b.inputs
            .extend(std::iter::repeat_n(i64::from(self.pad_id), pad));
        b.targets.extend(std::iter::repeat_n(IGNORE_INDEX, pad));
        if self.pack {
            b.positions.extend(0..pad as i64);
        }
        // Counts stay empty until a row has images, then cover every row (the first row's
        // included: `Batch::rows` cuts images by these counts).
        if row_images > 0 && b.row_images.is_empty() {
            b.row_images.resize(b.batch, 0);
        }
        if row_images > 0 || !b.row_images.is_empty() {
            b.row_images.push(row_images);
        }
        b.batch += 1;
    }

    /// Fills one row of `b` from `next` (which peeks at the next conversation and takes it): one
    /// conversation, or when packing as many whole ones as fit, in order (a conversation longer
    /// than a row is cut and fills a row alone).
    pub(crate) fn fill_row(
        &self,
        b: &mut Batch,
        docs: &[EncodedChat],
        mut next: impl FnMut(bool) -> Option<usize>,
    ) -> Result<()> {
        let (mut used, mut row_images, mut taken) = (0, 0, 0);
        while let Some(i) = next(false) {
            let need = self.slots(&docs[i]);
            // A full row, a conversation that does not fit beside the others, or (at most one
            // epoch's worth, so a run of empty conversations cannot spin) enough taken.
            if used == self.seq_len || (used > 0 && used + need > self.seq_len) {
                break;
            }
            next(true);
            used += self.push_doc(b, &docs[i], &mut row_images)?;
            taken += 1;
            if !self.pack || taken == docs.len() {
                break;
            }
        }
        self.end_row(b, used, row_images);
        Ok(())
    }
}

/// Conversations in a seeded, resumable order, `rows` of them per batch.
#[derive(Clone, Debug)]
pub struct ChatLoader {
    docs: Arc<[EncodedChat]>,
    shape: RowShape,
    order: EpochOrder,
}

impl ChatLoader {
    /// A loader at epoch 0, cursor 0 over `docs` (at least one).
    pub fn new(
        docs: Arc<[EncodedChat]>,
        shape: RowShape,
        seed: u64,
        shuffle: bool,
    ) -> Result<Self> {
        if docs.is_empty() {
            return Err(DataError::InvalidArgument {
                name: "conversations",
                message: "no conversation to train on".into(),
            });
        }
        let order = EpochOrder::new(docs.len(), seed, shuffle, "conversations")?;
        Ok(ChatLoader { docs, shape, order })
    }

    /// The next `rows` rows: a conversation each, or as many as fit when packing.
    pub fn next_batch(&mut self, rows: usize) -> Result<Batch> {
        let mut b = Batch::with_capacity(rows, self.shape.seq_len);
        let order = &mut self.order;
        for _ in 0..rows {
            self.shape.fill_row(&mut b, &self.docs, |take| {
                Some(match take {
                    true => order.next(),
                    false => order.peek(),
                })
            })?;
        }
        Ok(b)
    }

    /// Where the loader stands now.
    pub fn state(&self) -> LoaderState {
        self.order.state()
    }

    /// Moves the loader to `s` (taken from a loader over the same conversations and seed).
    pub fn restore(&mut self, s: &LoaderState) -> Result<()> {
        self.order.restore(s)
    }

    /// Conversations per epoch.
    pub fn conversations(&self) -> usize {
        self.docs.len()
    }

    /// `docs` in order, `rows` rows per batch (the last may have fewer), at most `max_batches`.
    pub fn eval_batches(
        docs: &[EncodedChat],
        shape: &RowShape,
        rows: usize,
        max_batches: usize,
    ) -> Result<Vec<Batch>> {
        let mut batches = Vec::new();
        let mut cursor = 0;
        while cursor < docs.len() && batches.len() < max_batches {
            let mut b = Batch::with_capacity(rows, shape.seq_len);
            while b.batch < rows.max(1) && cursor < docs.len() {
                shape.fill_row(&mut b, docs, |take| {
                    let i = (cursor < docs.len()).then_some(cursor);
                    cursor += usize::from(take);
                    i
                })?;
            }
            batches.push(b);
        }
        Ok(batches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `d` as one row of `b`.
    fn push(shape: &RowShape, b: &mut Batch, d: &EncodedChat) {
        let docs = std::slice::from_ref(d);
        shape.fill_row(b, docs, |_| Some(0)).unwrap();
    }

    fn doc(tokens: Vec<u32>, trained: Vec<bool>) -> EncodedChat {
        EncodedChat {
            tokens,
            trained,
            images: Vec::new(),
            image_spans: Vec::new(),
        }
    }

    #[test]
    fn a_row_is_one_conversation_padded_with_targets_on_the_reply_only() {
        let shape = RowShape {
            seq_len: 6,
            pad_id: 0,
            processor: None,
            pack: false,
        };
        let d = doc(vec![1, 2, 3, 4, 5], vec![false, false, false, true, true]);
        let mut b = Batch::with_capacity(1, 6);
        push(&shape, &mut b, &d);
        assert_eq!(b.inputs, [1, 2, 3, 4, 0, 0]);
        assert_eq!(b.targets, [-100, -100, 4, 5, -100, -100]);
        assert_eq!(b.trained_tokens(), 2);
        assert!(shape.trains_on(&d) && !shape.cuts(&d));

        // Cut to the row: the last target is token seq_len.
        let long = doc((1..=9).collect(), vec![true; 9]);
        let mut b = Batch::with_capacity(1, 6);
        push(&shape, &mut b, &long);
        assert_eq!(b.inputs, [1, 2, 3, 4, 5, 6]);
        assert_eq!(b.targets, [2, 3, 4, 5, 6, 7]);
        assert!(shape.cuts(&long));
        // A reply past the row's end leaves nothing to learn.
        let late = doc((1..=9).collect(), [vec![false; 8], vec![true]].concat());
        assert!(!shape.trains_on(&late));
    }

    #[test]
    fn packing_fills_rows_with_whole_conversations_at_their_own_positions() {
        let shape = RowShape {
            seq_len: 6,
            pad_id: 0,
            processor: None,
            pack: true,
        };
        // Slots (tokens but the last): 2, 3, 4, 7 (cut to 6), 1.
        let docs: Arc<[EncodedChat]> = [
            doc(vec![1, 2, 3], vec![false, true, true]),
            doc(vec![4, 5, 6, 7], vec![false, false, true, true]),
            doc(vec![8, 9, 10, 11, 12], vec![false, true, true, true, true]),
            doc((20..28).collect(), vec![true; 8]),
            doc(vec![30, 31], vec![false, true]),
        ]
        .into();
        let mut l = ChatLoader::new(docs.clone(), shape.clone(), 0, false).unwrap();
        let b = l.next_batch(3).unwrap();
        // Row 0: docs 0 and 1 (5 slots), doc 2 does not fit beside them: one pad.
        assert_eq!(b.inputs[..6], [1, 2, 4, 5, 6, 0]);
        assert_eq!(b.targets[..6], [2, 3, -100, 6, 7, -100]);
        assert_eq!(b.positions[..6], [0, 1, 0, 1, 2, 0]);
        // Row 1: doc 2 alone (doc 3 is a full row). Row 2: doc 3 cut to the row.
        assert_eq!(b.inputs[6..12], [8, 9, 10, 11, 0, 0]);
        assert_eq!(b.positions[6..12], [0, 1, 2, 3, 0, 1]);
        assert_eq!(b.inputs[12..], [20, 21, 22, 23, 24, 25]);
        assert_eq!(b.targets[12..], [21, 22, 23, 24, 25, 26]);
        assert_eq!(b.positions[12..], [0, 1, 2, 3, 4, 5]);
        // Resumes exactly: doc 4, then the next epoch's doc 0 and 1 beside it.
        let state = l.state();
        let want = l.next_batch(1).unwrap();
        assert_eq!(want.inputs, [30, 1, 2, 4, 5, 6]);
        assert_eq!(want.positions, [0, 0, 1, 0, 1, 2]);
        let mut again = ChatLoader::new(docs.clone(), shape.clone(), 0, false).unwrap();
        again.restore(&state).unwrap();
        assert_eq!(again.next_batch(1).unwrap(), want);
        // Held-out batches pack the same way, in order.
        let eval = ChatLoader::eval_batches(&docs, &shape, 2, 10).unwrap();
        assert_eq!(eval.len(), 2);
        assert_eq!(eval[0].inputs, b.inputs[..12]);
        assert_eq!(
            eval[1].inputs,
            [b.inputs[12..].to_vec(), vec![30, 0, 0, 0, 0, 0]].concat()
        );
        assert_eq!(eval[1].batch, 2);
    }

    #[test]
    fn an_image_that_does_not_fit_whole_is_cut_before_its_placeholders() {
        let shape = RowShape {
            seq_len: 6,
            pad_id: 0,
            processor: None,
            pack: false,
        };
        let mut d = doc(vec![1, 2, 3, 9, 9, 9, 9, 4], vec![false; 8]);
        d.images = vec!["x.png".into()];
        d.image_spans = vec![(3, 4)];
        assert_eq!(shape.kept(&d), 4);
        let mut b = Batch::with_capacity(1, 6);
        push(&shape, &mut b, &d);
        assert_eq!(b.inputs, [1, 2, 3, 0, 0, 0]);
        assert!(b.images.is_empty() && b.row_images.is_empty());
    }

    #[test]
    fn image_counts_cover_every_row_once_one_has_images() {
        let shape = RowShape {
            seq_len: 2,
            pad_id: 0,
            processor: None,
            pack: false,
        };
        let counts = |rows: &[usize]| {
            let mut b = Batch::with_capacity(rows.len(), 2);
            for &n in rows {
                shape.end_row(&mut b, 0, n);
            }
            b.row_images
        };
        assert_eq!(counts(&[0, 0]), Vec::<usize>::new());
        assert_eq!(
            counts(&[2, 0, 1]),
            [2, 0, 1],
            "the first row's images count"
        );
        assert_eq!(counts(&[0, 3, 0]), [0, 3, 0]);
    }

    #[test]
    fn the_order_resumes_where_it_was_taken() {
        let docs: Arc<[EncodedChat]> = (0..5)
            .map(|i| doc(vec![i, i + 1], vec![false, true]))
            .collect();
        let shape = RowShape {
            seq_len: 2,
            pad_id: 0,
            processor: None,
            pack: false,
        };
        let mut a = ChatLoader::new(docs.clone(), shape.clone(), 3, true).unwrap();
        a.next_batch(3).unwrap();
        let state = a.state();
        let want = a.next_batch(4).unwrap();
        let mut b = ChatLoader::new(docs, shape, 3, true).unwrap();
        b.restore(&state).unwrap();
        assert_eq!(b.next_batch(4).unwrap(), want);
    }
}
