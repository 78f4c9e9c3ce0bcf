"""An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.retry_after = status, kind, param, code, retry_after

    @classmethod
    def bad_api_key(cls) -> OpenAIError:
        return cls(
            401,
            "missing or wrong API key (create one in the panel's Settings)",
            kind="invalid_request_error",
            code="invalid_api_key",
        )

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(int(self.retry_after))} if self.retry_after else None
        return JSONResponse(
            {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}},
            status_code=self.status,
            headers=headers,
        )
