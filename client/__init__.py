"""BubbleSpec client SDK: what a trainer imports (grpcio + protobuf only).

    from bubblespec.client import RolloutClient, SamplingParams

    with RolloutClient("scheduler:50051", token="...") as client:
        client.update_policy(1, "/ckpt/step-1")
        result = client.generate(step=1, prompts=["2+3=", "7*6="], policy_version=1,
                                 sampling=SamplingParams(temperature=1.0, max_tokens=512), n=8,
                                 lookahead=next_prompts)
        for c in result.completions:
            print(c.prompt_id, c.sample_index, c.text)
"""

from bubblespec.client._async import AsyncRolloutClient
from bubblespec.client._base import ClientSettings, Retry
from bubblespec.client._sync import RolloutClient
from bubblespec.client.errors import (
    AlreadyExists, AuthenticationFailed, BubbleSpecError, DeadlineExceeded, FatalError, InvalidArgument, NotFound,
    PreconditionFailed, ResourceExhausted, RetryableError, ServerError, ServiceUnavailable, StepCancelled,
)
from bubblespec.common.types import (
    Completion, FinishReason, Prompt, PromptLogprob, Provenance, SamplingParams, SchedulingPolicy, SourceStats,
    StepResult, StepSummary,
)

__all__ = [
    "AlreadyExists", "AsyncRolloutClient", "AuthenticationFailed", "BubbleSpecError", "ClientSettings",
    "Completion", "DeadlineExceeded", "FatalError", "FinishReason", "InvalidArgument", "NotFound",
    "PreconditionFailed", "Prompt", "PromptLogprob", "Provenance", "ResourceExhausted", "Retry", "RetryableError",
    "RolloutClient", "SamplingParams", "SchedulingPolicy", "ServerError", "ServiceUnavailable", "SourceStats",
    "StepCancelled", "StepResult", "StepSummary",
]
