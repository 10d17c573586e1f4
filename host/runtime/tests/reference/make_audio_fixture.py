#!/usr/bin/env python3
"""Writes the audio inputs and transformers' outputs of `tiny_muse_spark` (Muse Spark Open's
raw-waveform audio tower) for the audio tests; the checkpoint itself (written by
`make_hf_fixtures.py`) is only read.

Needs torch, numpy, safetensors and transformers (5.x, with `muse_spark`); run from the
repository root:

    python host/runtime/tests/reference/make_audio_fixture.py

Loads `host/runtime/tests/fixtures/tiny_muse_spark/` with `from_pretrained` (float32, eager
attention and experts) and writes beside it:
- `audio0.wav` (mono) and `audio1.wav` (stereo), 24 kHz 16-bit PCM: two clips of sines plus
  seeded noise, 100 and 56 frames long, so 13 and 7 audio tokens of the fixture's 8 samples
  (`patch_sizes` [4, 2]); the first ends inside a token, which is padded with zeros;
- `expected_audio.safetensors` holding
  - `input_values` (f32 [2, 104]) and `audio_lengths` (i64 [2]): `MuseSparkFeatureExtractor`'s
    output for the clips as the WAV files decode (16-bit `v / 32768`, the stereo one's two
    channels averaged in f32), which is what the model is given;
  - `tokens` (i64 [1, T]): a prompt holding the clips' 13 and 7 placeholders (`audio_token_id`
    93) between text, as `MuseSparkProcessor` lays them out (less its start and end tokens,
    which the tiny vocabulary lacks);
  - `audio_embeds` (f32 [20, 64]): `get_audio_features(...).pooler_output` (the tower's output
    normed by the embedding's `embed_norm`, each clip's real tokens);
  - `logits` (f32 [1, T, V]), `logprobs` (f32 [1, T-1]) and `loss`: the model with the audio and
    its next-token cross entropy;
  - `grad.<name>`: every gradient of that loss under the checkpoint's names (saved as the
    weights with `save_pretrained`, as `make_hf_fixtures.py`'s `deepseek_v4_grads` does; zeros
    for the parameters the forward leaves alone: the vision tower).

It also checks that the same weights in float64 give logits and audio embeddings within 1e-5
of the float32 run and gradients within 3e-5 (of each tensor's largest), so another
implementation can match it in f32 within the tests' 1e-4. The experts run transformers' eager
implementation (its grouped products take no float64).
"""
import copy
import os
import pathlib
import tempfile
import wave

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import MuseSparkFeatureExtractor, MuseSparkForConditionalGeneration

DIR = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "tiny_muse_spark"
RATE = 24_000


def clip(frames, channels, freqs, seed):
    """`frames` × `channels` 16-bit samples: sines of `freqs` (Hz, one set per channel, shifted
    per channel) plus seeded noise, within ±0.9 of full scale."""
    t = np.arange(frames) / RATE
    rng = np.random.default_rng(seed)
    out = []
    for c in range(channels):
        x = sum(np.sin(2 * np.pi * f * (1 + 0.1 * c) * t + k) / len(freqs) for k, f in enumerate(freqs))
        x = 0.7 * x + 0.2 * rng.uniform(-1, 1, frames)
        out.append(np.round(x * 32767).astype(np.int16))
    return np.stack(out, axis=1)


def write_wav(path, samples):
    """16-bit PCM at 24 kHz, channels interleaved."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(samples.shape[1])
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(samples.astype("<i2").tobytes())


def decoded(samples):
    """What a WAV decoder gives: `v / 32768` per channel, the channels averaged in f32."""
    x = samples.astype(np.float32) / np.float32(32768)
    mono = x[:, 0]
    for c in range(1, x.shape[1]):
        mono = mono + x[:, c]
    return (mono / np.float32(x.shape[1])).astype(np.float32)


def checkpoint_grads(model, tmp):
    """`make_hf_fixtures.py`'s `deepseek_v4_grads`: every gradient under the name the checkpoint
    uses, found by saving the gradients as the weights with transformers' own save_pretrained;
    parameters without a gradient get zeros; buffers are left out."""
    grads = copy.deepcopy(model)
    with torch.no_grad():
        for (name, p), (_, g) in zip(model.named_parameters(), grads.named_parameters()):
            g.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    grads.save_pretrained(tmp, safe_serialization=True)
    out = load_file(str(pathlib.Path(tmp) / "model.safetensors"))
    return {k: v for k, v in out.items() if not k.endswith(("tid2eid", "gate.bias"))}


def run(model, tokens, values, mask):
    """Logits, loss and the audio embeddings of the prompt with its audio; gradients on `model`."""
    model.zero_grad(set_to_none=True)
    embeds = model.model.get_audio_features(values, mask).pooler_output
    logits = model(tokens, input_values=values, input_values_mask=mask).logits
    vocab = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    return logits, loss, embeds


def main():
    model = MuseSparkForConditionalGeneration.from_pretrained(DIR, dtype=torch.float32, attn_implementation="eager",
                                                              experts_implementation="eager")
    model.eval()
    cfg = model.config
    per_token = cfg.audio_config.samples_per_token
    raw = [clip(100, 1, [440.0, 1250.0, 3100.0], 11), clip(56, 2, [660.0, 2300.0], 12)]
    for k, samples in enumerate(raw):
        write_wav(DIR / f"audio{k}.wav", samples)
    clips = [decoded(s) for s in raw]
    fe = MuseSparkFeatureExtractor(samples_per_token=per_token)
    inputs = fe(clips, sampling_rate=RATE, return_tensors="pt")
    values, mask = inputs["input_values"].float(), inputs["input_values_mask"]
    lengths = mask.sum(-1)
    counts = [-(-int(n) // per_token) for n in lengths]
    assert counts == [13, 7], counts

    g = torch.Generator().manual_seed(5)
    text = torch.randint(0, 90, (1, 12), generator=g)
    audio = cfg.audio_token_id
    tokens = torch.cat([text[:, :3], torch.full((1, counts[0]), audio), text[:, 3:7],
                        torch.full((1, counts[1]), audio), text[:, 7:]], dim=1)

    logits, loss, embeds = run(model, tokens, values, mask)
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    out = {"input_values": values.contiguous(), "audio_lengths": lengths.to(torch.int64),
           "tokens": tokens.contiguous(), "audio_embeds": embeds.detach().contiguous(),
           "logits": logits.detach().contiguous(), "logprobs": lp.detach().contiguous(),
           "loss": loss.detach().reshape(1)}
    with tempfile.TemporaryDirectory() as tmp:
        out |= {"grad." + k: v.contiguous() for k, v in checkpoint_grads(model, tmp).items()}

    # The audio reaches the logits: without it (the placeholders' own embeddings) they differ.
    with torch.no_grad():
        plain = model(tokens).logits
    print(f"  logits with and without the audio differ by up to {float((plain - logits.detach()).abs().max()):.3f}")

    wide = copy.deepcopy(model).double()
    wide_logits, _, wide_embeds = run(wide, tokens, values.double(), mask)
    dlogits = float((wide_logits.detach() - logits.detach().double()).abs().max())
    dembeds = float((wide_embeds.detach() - embeds.detach().double()).abs().max())
    dgrad, worst = 0.0, None
    for (name, p), (_, w) in zip(model.named_parameters(), wide.named_parameters()):
        if w.grad is not None and float(w.grad.abs().max()) > 0:
            d = float((p.grad.double() - w.grad).abs().max() / w.grad.abs().max())
            dgrad, worst = max((dgrad, worst), (d, name))
    print(f"  f32 vs f64: max |logit diff| {dlogits:.2e}, |embedding diff| {dembeds:.2e}, "
          f"max relative gradient diff {dgrad:.2e} ({worst})")
    # The tests allow 1e-4 (relative, for gradients): f32 rounding must stay well below it.
    assert dlogits < 1e-5 and dembeds < 1e-5 and dgrad < 3e-5, "f32 rounding too large for the parity tests"

    save_file(out, str(DIR / "expected_audio.safetensors"))
    print("tiny_muse_spark: audio", [len(c) for c in clips], "samples,", counts, "tokens; prompt",
          tokens.shape[1], "tokens; loss", float(loss.detach()))


if __name__ == "__main__":
    main()
