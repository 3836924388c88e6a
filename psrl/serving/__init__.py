"""What the router and the SessionRouter share as HTTP servers: `limits` (the per-connection bounds, as settings),
`protocol` (the uvicorn protocol that enforces them, with JSON errors for framing problems), `json_body` (bounded
JSON body parsing) and `server` (uvicorn with a ready line). Import from the modules: config modules take only
`limits`, which loads no server code."""
