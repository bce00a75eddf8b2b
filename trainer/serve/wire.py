"""The tinker SDK's protobuf wire (forward_backward requests; ForwardBackwardOutput and SampleResponse results).

The SDK (0.38) sends /api/v1/forward_backward as `application/x-protobuf` (zstd-compressed when the server's
client config asks) and reads ForwardBackwardOutput and SampleResponse futures only as protobuf. The schema is
the SDK's own (`tinker.proto.tinker_public_pb2`): the server reads its owner's definition, never a copy of it.
Everything else on the wire is JSON.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trainer.backend.protocol import Datum, ForwardOutput

PROTO = "application/x-protobuf"


def _pb():
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:  # the service's one optional dependency
        raise ImportError("python -m trainer serve reads the tinker SDK's wire schema: pip install "
                          "'tinker==0.38.*' (the project's dev extra)") from e
    return tinker_public_pb2


def _np_dtype(pb, dtype: int) -> np.dtype:
    table = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if dtype not in table:
        raise ValueError(f"tensor dtype {dtype} is not supported: send float32 or int64 loss_fn_inputs")
    return np.dtype(table[dtype])


def _tensor(pb, msg) -> torch.Tensor:
    """A proto Tensor (dense, or CSR [rows, cols] with zeros elsewhere) as a flat torch tensor."""
    dtype = _np_dtype(pb, msg.dtype)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        shape = list(msg.shape)
        rows, cols = (shape[0], int(np.prod(shape[1:]))) if len(shape) > 1 else (1, shape[0])
        dense = np.zeros((rows, cols), dtype=dtype)
        for r in range(rows):
            dense[r, col[crow[r]: crow[r + 1]]] = values[crow[r]: crow[r + 1]]
        return torch.from_numpy(dense.reshape(-1).copy())
    return torch.from_numpy(np.frombuffer(msg.dense, dtype=dtype).copy())


def decode_forward_backward(body: bytes, encoding: str | None) -> tuple[dict, list[Datum]]:
    """(header {model_id, seq_id, loss_fn, loss_fn_config, forward_only}, datums) of a forward_backward body."""
    pb = _pb()
    if encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
    from google.protobuf.message import DecodeError

    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise ValueError(f"the body is not a tinker ForwardBackwardRequest (application/x-protobuf): {e}") from e
    config: dict = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = _data(pb, msg)
    header = {"model_id": msg.model_id, "seq_id": msg.seq_id, "loss_fn": msg.loss_fn, "loss_fn_config": config,
              "forward_only": msg.forward_only}
    return header, data


def _data(pb, msg) -> list[Datum]:
    """The datums of a parsed ForwardBackwardRequest. Each field's bytes of every datum are joined and read once
    (one buffer and one tensor per field, split into per-datum views): one conversion per datum made the decode of
    a 512-datum batch cost more than the rest of the round trip."""
    tokens, lengths, fields = [], [], {}
    for i, d in enumerate(msg.data):
        n = 0
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise ValueError(f"datum {i}: a {kind} chunk; this server takes token chunks (EncodedTextChunk) only")
            tokens.append(chunk.encoded_text.tokens)  # int32 bytes
            n += len(chunk.encoded_text.tokens) // 4
        lengths.append(n)
        for k, t in d.loss_fn_inputs.items():
            fields.setdefault(k, {})[i] = t
    ids = torch.from_numpy(np.frombuffer(b"".join(tokens), dtype=np.int32).astype(np.int64)).split(lengths)
    inputs: list[dict[str, torch.Tensor]] = [{} for _ in lengths]
    for k, per in fields.items():
        dtypes = {t.dtype for t in per.values()}
        if len(dtypes) == 1 and not any(t.HasField("sparse_csr") for t in per.values()):
            flat = torch.from_numpy(np.frombuffer(b"".join(t.dense for t in per.values()),
                                                  dtype=_np_dtype(pb, dtypes.pop())).copy())
            for i, v in zip(per, flat.split([len(t.dense) // flat.element_size() for t in per.values()])):
                inputs[i][k] = v
        else:  # mixed dtypes or sparse tensors: one at a time
            for i, t in per.items():
                inputs[i][k] = _tensor(pb, t)
    return [Datum(x, y) for x, y in zip(ids, inputs)]


def encode_forward_output(out: ForwardOutput) -> bytes:
    """ForwardBackwardOutput: one ArrayRecord whose fields batch every datum's [T] float32 output by offsets."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in out.metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(out.outputs)
    for name in (out.outputs[0] if out.outputs else {}):
        arrays = [o[name].detach().cpu().float().numpy().reshape(-1) for o in out.outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        field = record.fields[name]
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.tobytes()
        field.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def encode_sample_response(sequences: Sequence[tuple[list[int], list[float], str]],
                           prompt_logprobs: Sequence[float] | None) -> bytes:
    """SampleResponse: per sequence (tokens, logprobs, "stop" | "length"); prompt log-probs NaN where undefined."""
    pb = _pb()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = reasons[reason]
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
