"""The errors the TITO store raises; each `code` names the reason for the router's error mapping."""


class TitoError(ValueError):
    """A TITO request the store refuses; `code` names the reason for the router's error mapping."""

    code = "tito_error"


class SessionNotFound(TitoError):
    code = "session_not_found"


class TooManySessions(TitoError):
    code = "too_many_sessions"


class TooManyClientSessions(TooManySessions):
    """One client holds max_sessions_per_client live sessions already."""

    code = "too_many_client_sessions"


class TooManyTurns(TitoError):
    code = "too_many_turns"


class TurnNotRecorded(TitoError):
    """A turn was prepared on the trajectory and neither recorded nor abandoned."""

    code = "turn_not_recorded"


class TurnNotPrepared(TitoError):
    """record_turn got a PreparedTurn that is not the trajectory's pending one."""

    code = "turn_not_prepared"


class InvalidTurn(TitoError):
    code = "invalid_turn"


class TemplateRenderError(TitoError):
    code = "template_error"
