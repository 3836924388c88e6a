"""The other agent-facing API shapes, converted to and from OpenAI chat: the OpenAI Responses API and
Anthropic's Messages API, plus their SSE event sequences, written as a generation streams (ResponseStream,
MessageStream) or built from a finished (buffered) result. Pure: no I/O.

The router serves `/v1/responses` and `/v1/messages` by converting the request to a chat request, running
its chat pipeline (TITO included) and converting the chat completion back, or streaming it as it is
generated; the SessionRouter builds the streams its clients ask for from the buffered results.
"""

from psrl.apis.chat_sse import chat_sse_events
from psrl.apis.common import ApiShapeError
from psrl.apis.messages import (
    MessageStream,
    chat_to_message,
    message_base,
    message_id_of,
    message_sse_events,
    message_usage,
    messages_to_chat,
    stop_reason_of,
    tool_input_of,
)
from psrl.apis.responses import (
    ResponseStream,
    chat_to_response,
    response_base,
    response_id_of,
    response_outcome,
    response_sse_events,
    responses_to_chat,
)

__all__ = [
    "ApiShapeError",
    "MessageStream",
    "ResponseStream",
    "chat_sse_events",
    "chat_to_message",
    "chat_to_response",
    "message_base",
    "message_id_of",
    "message_sse_events",
    "message_usage",
    "messages_to_chat",
    "response_base",
    "response_id_of",
    "response_outcome",
    "response_sse_events",
    "responses_to_chat",
    "stop_reason_of",
    "tool_input_of",
]
