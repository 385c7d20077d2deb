"""Conversions between the engine's typed messages and their protobuf form (no torch).

The scheduler encodes a SchedulerOutput into a StepRequest and decodes the StepResult; the worker
does the reverse. Kept in one place so that a field added to a message is added to both sides.
"""

from __future__ import annotations

from pagedserve.common.messages import CachedRequestData, ModelRunnerOutput, NewRequestData, PromptLogprobs, \
    SampledToken, SchedulerOutput
from pagedserve.common.multimodal import image_from_proto, image_to_proto
from pagedserve.common.sampling_params import Pooling, SamplingParams, StructuredOutput
from pagedserve.v1 import common_pb2, worker_pb2


# ---- sampling parameters --------------------------------------------------------------------
def params_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int = 16) -> SamplingParams:
    """Build and validate SamplingParams; raises ValueError naming the bad field."""
    return SamplingParams(
        n=msg.n or 1,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k, min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        min_tokens=msg.min_tokens, stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        structured_output=structured_output_from_proto(msg.structured_output)
        if msg.HasField("structured_output") else None,
        logit_bias=dict(msg.logit_bias) or None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        cache_salt=msg.cache_salt, lora_name=msg.lora_name, lora_path=msg.lora_path,
        pooling=Pooling(msg.pooling.type, msg.pooling.normalize) if msg.HasField("pooling") else None,
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        bad_words_token_ids=[list(w.ids) for w in msg.bad_words_token_ids] or None)


def structured_output_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutput:
    return StructuredOutput(msg.json_schema, msg.json_object, msg.regex, list(msg.choice), msg.grammar,
                            msg.reasoning_end, msg.structural_tag)


def structured_output_to_proto(so: StructuredOutput, msg: common_pb2.StructuredOutput) -> None:
    msg.SetInParent()
    msg.json_schema = so.json_schema
    msg.json_object = so.json_object
    msg.regex = so.regex
    msg.choice[:] = so.choice
    msg.grammar = so.grammar
    msg.reasoning_end = so.reasoning_end
    msg.structural_tag = so.structural_tag


def params_to_proto(params: SamplingParams, out: common_pb2.SamplingParams | None = None) -> common_pb2.SamplingParams:
    msg = out if out is not None else common_pb2.SamplingParams()
    msg.n = params.n
    msg.temperature = params.temperature
    msg.top_p = params.top_p
    msg.top_k = params.top_k
    msg.min_p = params.min_p
    msg.repetition_penalty = params.repetition_penalty
    msg.presence_penalty = params.presence_penalty
    msg.frequency_penalty = params.frequency_penalty
    if params.seed is not None:
        msg.seed = params.seed
    msg.max_tokens = params.max_tokens
    msg.min_tokens = params.min_tokens
    msg.stop_token_ids[:] = params.stop_token_ids
    msg.ignore_eos = params.ignore_eos
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.structured_output is not None:
        structured_output_to_proto(params.structured_output, msg.structured_output)
    if params.logit_bias:
        msg.logit_bias.update(params.logit_bias)
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    msg.cache_salt = params.cache_salt
    if params.pooling is not None:
        msg.pooling.type = params.pooling.type
        msg.pooling.normalize = params.pooling.normalize
    msg.lora_name = params.lora_name
    msg.lora_path = params.lora_path
    if params.allowed_token_ids:
        msg.allowed_token_ids[:] = params.allowed_token_ids
    for word in params.bad_words_token_ids or ():
        msg.bad_words_token_ids.add(ids=word)
    return msg


# ---- sampled tokens -------------------------------------------------------------------------
def token_to_proto(token: SampledToken, out: common_pb2.TokenLogprob) -> None:
    out.token_id = token.token_id
    if token.logprob is not None:
        out.logprob = token.logprob
    if token.top_logprobs:
        for token_id, logprob in token.top_logprobs:
            out.top.add(token_id=token_id, logprob=logprob)
    if token.rank is not None:
        out.rank = token.rank


def token_from_proto(msg: common_pb2.TokenLogprob, with_logprobs: bool) -> SampledToken:
    if not with_logprobs:
        return SampledToken(msg.token_id)
    return SampledToken(msg.token_id, msg.logprob, [(t.token_id, t.logprob) for t in msg.top], msg.rank or None)


# ---- one step -------------------------------------------------------------------------------
def step_to_proto(step: SchedulerOutput, session_id: str = "") -> worker_pb2.StepRequest:
    msg = worker_pb2.StepRequest(step_id=step.step_id, session_id=session_id,
                                 scheduled_req_ids=list(step.num_scheduled_tokens),
                                 num_scheduled_tokens=list(step.num_scheduled_tokens.values()),
                                 finished_req_ids=step.finished_req_ids)
    for new in step.new_requests:
        entry = msg.new_requests.add(req_id=new.req_id, token_ids=new.token_ids,
                                     num_prompt_tokens=new.num_prompt_tokens, block_ids=new.block_ids,
                                     num_computed_tokens=new.num_computed_tokens,
                                     sample_index=new.sample_index, child_req_ids=new.child_req_ids)
        for ids in new.group_block_ids:
            entry.group_block_ids.add(ids=ids)
        for image in new.images:
            image_to_proto(image, entry.images.add())
        params_to_proto(new.params, entry.params)
    for cached in step.cached_requests:
        entry = msg.cached_requests.add(req_id=cached.req_id, new_block_ids=cached.new_block_ids)
        if cached.replaced_block is not None:
            entry.replaced_index, entry.replaced_block_id = cached.replaced_block
        if cached.block_ids is not None:
            entry.has_block_ids = True
            entry.block_ids[:] = cached.block_ids
            for ids in cached.group_block_ids or ():
                entry.group_block_ids.add(ids=ids)
        for ids in cached.group_new_block_ids:
            entry.group_new_block_ids.add(ids=ids)
        for group, index, block_id in cached.group_replaced:
            entry.group_replaced.add(group=group, index=index, block_id=block_id)
    for pairs, field in ((step.blocks_to_copy, msg.blocks_to_copy), (step.blocks_to_swap_out, msg.blocks_to_swap_out),
                         (step.blocks_to_swap_in, msg.blocks_to_swap_in)):
        for src, dst in pairs:
            field.add(src=src, dst=dst)
    for req_id, proposals in step.spec_token_ids.items():
        msg.spec_tokens.add(req_id=req_id, token_ids=proposals)
    for spec in step.grammars:
        structured_output_to_proto(spec, msg.grammars.add())
    return msg


def step_from_proto(msg: worker_pb2.StepRequest) -> SchedulerOutput:
    new_requests = [NewRequestData(
        req_id=new.req_id, token_ids=list(new.token_ids), num_prompt_tokens=new.num_prompt_tokens,
        params=params_from_proto(new.params), block_ids=list(new.block_ids),
        num_computed_tokens=new.num_computed_tokens, sample_index=new.sample_index,
        child_req_ids=list(new.child_req_ids), group_block_ids=[list(t.ids) for t in new.group_block_ids],
        images=[image_from_proto(image) for image in new.images])
        for new in msg.new_requests]
    cached_requests = [CachedRequestData(
        req_id=c.req_id, new_block_ids=list(c.new_block_ids),
        replaced_block=(c.replaced_index, c.replaced_block_id) if c.HasField("replaced_index") else None,
        block_ids=list(c.block_ids) if c.has_block_ids else None,
        group_new_block_ids=[list(t.ids) for t in c.group_new_block_ids],
        group_replaced=[(r.group, r.index, r.block_id) for r in c.group_replaced],
        group_block_ids=[list(t.ids) for t in c.group_block_ids] if c.has_block_ids else None)
        for c in msg.cached_requests]
    return SchedulerOutput(
        step_id=msg.step_id, new_requests=new_requests, cached_requests=cached_requests,
        num_scheduled_tokens=dict(zip(msg.scheduled_req_ids, msg.num_scheduled_tokens)),
        finished_req_ids=list(msg.finished_req_ids),
        blocks_to_copy=[(p.src, p.dst) for p in msg.blocks_to_copy],
        blocks_to_swap_out=[(p.src, p.dst) for p in msg.blocks_to_swap_out],
        blocks_to_swap_in=[(p.src, p.dst) for p in msg.blocks_to_swap_in],
        spec_token_ids={entry.req_id: list(entry.token_ids) for entry in msg.spec_tokens},
        grammars=[structured_output_from_proto(spec) for spec in msg.grammars])


def result_to_proto(result: ModelRunnerOutput, worker_time_s: float = 0.0) -> worker_pb2.StepResult:
    msg = worker_pb2.StepResult(step_id=result.step_id, forward_time_s=result.forward_time_s,
                                sample_time_s=result.sample_time_s, worker_time_s=worker_time_s)
    for req_id, tokens in result.sampled.items():
        entry = msg.sampled.add(req_id=req_id)
        for token in tokens:
            token_to_proto(token, entry.tokens.add())
    for req_id, prompt in result.prompt_logprobs.items():
        entry = msg.prompt_logprobs.add(req_id=req_id, start=prompt.start)
        for token in prompt.tokens:
            token_to_proto(token, entry.tokens.add())
    for req_id, data in result.pooled.items():
        msg.pooled.add(req_id=req_id, data=data)
    msg.failed.update(result.failed)
    msg.grammars_ready[:] = result.grammars_ready
    return msg


def result_from_proto(msg: worker_pb2.StepResult, wants_logprobs: set[str] | None = None) -> ModelRunnerOutput:
    """wants_logprobs: the request ids that asked for logprobs (others get bare token ids)."""
    sampled = {}
    for entry in msg.sampled:
        with_logprobs = wants_logprobs is not None and entry.req_id in wants_logprobs
        sampled[entry.req_id] = [token_from_proto(t, with_logprobs) for t in entry.tokens]
    prompt = {entry.req_id: PromptLogprobs(entry.start, [token_from_proto(t, True) for t in entry.tokens])
              for entry in msg.prompt_logprobs}
    return ModelRunnerOutput(msg.step_id, sampled, msg.forward_time_s, msg.sample_time_s, prompt,
                             {entry.req_id: entry.data for entry in msg.pooled}, dict(msg.failed),
                             list(msg.grammars_ready))


# ---- timings --------------------------------------------------------------------------------
TIMING_FIELDS = tuple(f.name for f in common_pb2.Timings.DESCRIPTOR.fields)


def timings_to_dict(msg: common_pb2.Timings) -> dict[str, float]:
    return {name: getattr(msg, name) for name in TIMING_FIELDS}


def timings_from_dict(values: dict, out: common_pb2.Timings | None = None) -> common_pb2.Timings:
    msg = out if out is not None else common_pb2.Timings()
    for name in TIMING_FIELDS:
        value = values.get(name)
        if value:
            setattr(msg, name, type(getattr(msg, name))(value))
    return msg
