"""Aggregations for `Dataset.groupby(...).aggregate(...)`, named as Ray Data names them."""


class AggregateFn:
    """`function(on)` as the column `alias_name` (floe's default name when None)."""

    function = None

    def __init__(self, on=None, alias_name=None):
        if on is None and self.function != "count":
            raise ValueError("%s needs a column: %s(\"column\")" % (type(self).__name__, type(self).__name__))
        self.on = on
        self.alias_name = alias_name

    def _spec(self):
        return (self.function, self.on, self.alias_name)

    def __repr__(self):
        return "%s(%r)" % (type(self).__name__, self.on)


class Count(AggregateFn):
    """Rows in the group (`Count()`), or non-null values of a column (`Count("v")`)."""

    function = "count"


class Sum(AggregateFn):
    function = "sum"


class Mean(AggregateFn):
    function = "mean"


class Min(AggregateFn):
    function = "min"


class Max(AggregateFn):
    function = "max"


class Std(AggregateFn):
    function = "std"
