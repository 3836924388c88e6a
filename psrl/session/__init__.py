"""The SessionRouter: a FastAPI front for agent sessions over the router's TITO (COMPAT section 7)."""

from psrl.session.app import create_app
from psrl.session.config import SessionConfig
from psrl.session.state import SessionState, SessionStore

__all__ = ["SessionConfig", "SessionState", "SessionStore", "create_app"]
