"""Dependencies, declared once as `Annotated` aliases; routes never reach for singletons."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.api.auth import authenticate
from gateway.persistence.keys import Principal
from gateway.services import Services


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]
PrincipalDep = Annotated[Principal, Depends(authenticate)]
