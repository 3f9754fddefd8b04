"""Settings of usage accounting (`settings.usage`, env `KVGATE_USAGE__<FIELD>`)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Price(BaseModel):
    """US dollars per million tokens."""

    input: float = Field(ge=0)
    cached_input: float = Field(ge=0)
    output: float = Field(ge=0)


class UsageSettings(BaseModel):
    prices: dict[str, Price] = Field(
        default_factory=dict, description="Per model: input, cached_input, output in USD per million tokens."
    )
    default_price: Price = Field(
        default_factory=lambda: Price(input=0.15, cached_input=0.075, output=0.60),
        description="Price of models missing from `prices` (for cost and savings estimates).",
    )

    def price_for(self, model: str | None) -> Price:
        return self.prices.get(model or "", self.default_price)
