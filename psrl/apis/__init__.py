"""The other agent-facing API shapes, converted to and from OpenAI chat: the OpenAI Responses API and
Anthropic's Messages API, plus SSE event sequences built from a finished (buffered) result. Pure: no I/O.

The router serves `/v1/responses` and `/v1/messages` by converting the request to a chat request, running
its chat pipeline (TITO included) and converting the chat completion back; the SessionRouter builds the
streams its clients ask for from the buffered results.
"""

from psrl.apis.chat_sse import chat_sse_events
from psrl.apis.common import ApiShapeError
from psrl.apis.messages import chat_to_message, message_sse_events, messages_to_chat
from psrl.apis.responses import chat_to_response, response_sse_events, responses_to_chat

__all__ = [
    "ApiShapeError",
    "chat_sse_events",
    "chat_to_message",
    "chat_to_response",
    "message_sse_events",
    "messages_to_chat",
    "response_sse_events",
    "responses_to_chat",
]
