//! Encoded conversations served as batches: one conversation per row, padded to the row's
//! length, so no token attends across conversations and every row's positions start at 0.
//! Each row's images are read and processed when its batch is made, concatenated row by row.

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

    /// Appends `doc` as one row of `b`, its images processed.
    fn push(&self, b: &mut Batch, doc: &EncodedChat) -> Result<()> {
        let n = self.kept(doc);
        let t = self.seq_len;
        let inputs = doc.tokens[..n - 1].iter().map(|&id| i64::from(id));
        b.inputs.extend(inputs);
        b.inputs
            .extend(std::iter::repeat_n(i64::from(self.pad_id), t + 1 - n));
        for j in 1..n {
            b.targets.push(match doc.trained[j] {
                true => i64::from(doc.tokens[j]),
                false => IGNORE_INDEX,
            });
        }
        b.targets
            .extend(std::iter::repeat_n(IGNORE_INDEX, t + 1 - n));
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
        }
        // Counts stay empty until a row has images, then cover every row.
        if kept > 0 && b.row_images.len() < b.batch {
            b.row_images.resize(b.batch, 0);
        }
        if !b.row_images.is_empty() {
            b.row_images.push(kept);
        }
        b.batch += 1;
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

    /// The next `rows` conversations as one batch.
    pub fn next_batch(&mut self, rows: usize) -> Result<Batch> {
        let mut b = Batch::with_capacity(rows, self.shape.seq_len);
        for _ in 0..rows {
            let doc = &self.docs[self.order.next()];
            self.shape.push(&mut b, doc)?;
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

    /// `docs` in order, `rows` per batch (the last may have fewer), at most `max_batches`.
    pub fn eval_batches(
        docs: &[EncodedChat],
        shape: &RowShape,
        rows: usize,
        max_batches: usize,
    ) -> Result<Vec<Batch>> {
        docs.chunks(rows.max(1))
            .take(max_batches)
            .map(|chunk| {
                let mut b = Batch::with_capacity(chunk.len(), shape.seq_len);
                for doc in chunk {
                    shape.push(&mut b, doc)?;
                }
                Ok(b)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        };
        let d = doc(vec![1, 2, 3, 4, 5], vec![false, false, false, true, true]);
        let mut b = Batch::with_capacity(1, 6);
        shape.push(&mut b, &d).unwrap();
        assert_eq!(b.inputs, [1, 2, 3, 4, 0, 0]);
        assert_eq!(b.targets, [-100, -100, 4, 5, -100, -100]);
        assert_eq!(b.trained_tokens(), 2);
        assert!(shape.trains_on(&d) && !shape.cuts(&d));

        // Cut to the row: the last target is token seq_len.
        let long = doc((1..=9).collect(), vec![true; 9]);
        let mut b = Batch::with_capacity(1, 6);
        shape.push(&mut b, &long).unwrap();
        assert_eq!(b.inputs, [1, 2, 3, 4, 5, 6]);
        assert_eq!(b.targets, [2, 3, 4, 5, 6, 7]);
        assert!(shape.cuts(&long));
        // A reply past the row's end leaves nothing to learn.
        let late = doc((1..=9).collect(), [vec![false; 8], vec![true]].concat());
        assert!(!shape.trains_on(&late));
    }

    #[test]
    fn an_image_that_does_not_fit_whole_is_cut_before_its_placeholders() {
        let shape = RowShape {
            seq_len: 6,
            pad_id: 0,
            processor: None,
        };
        let mut d = doc(vec![1, 2, 3, 9, 9, 9, 9, 4], vec![false; 8]);
        d.images = vec!["x.png".into()];
        d.image_spans = vec![(3, 4)];
        assert_eq!(shape.kept(&d), 4);
        let mut b = Batch::with_capacity(1, 6);
        shape.push(&mut b, &d).unwrap();
        assert_eq!(b.inputs, [1, 2, 3, 0, 0, 0]);
        assert!(b.images.is_empty() && b.row_images.is_empty());
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
