"""A small solver-neutral model: integer variables, linear constraints that may be enforced by
binary literals, a linear objective to minimise, and a hint. Backends translate it: CP-SAT uses
enforcement literals natively, PuLP gets big-M rows computed from the variables' bounds."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Var:
    """An integer variable. ``lp_integral``: integer for an LP-based solver (CBC, HiGHS, SCIP);
    CP-SAT keeps every variable integral."""

    index: int
    name: str
    lb: int
    ub: int
    lp_integral: bool = False


@dataclass
class Constraint:
    """lo <= sum(coef * var) <= hi, only when every variable in ``enforce`` is 1."""

    name: str
    terms: list[tuple[int, int]]
    lo: int | None
    hi: int | None
    enforce: tuple[int, ...] = ()


@dataclass
class Model:
    vars: list[Var] = field(default_factory=list)
    constraints: list[Constraint] = field(default_factory=list)
    objective: list[tuple[int, int]] = field(default_factory=list)
    objective_offset: int = 0
    hint: dict[int, int] = field(default_factory=dict)

    def var(self, name: str, lb: int, ub: int, *, lp_integral: bool | None = None) -> int:
        """A new variable in [lb, ub]; returns its index. ``lp_integral`` (default: a binary
        is, any other is not): whether an LP-based solver keeps it integer. The decisions'
        binaries are; times, lanes and memory sums are continuous there, and so is an indicator
        bounded below by the binaries it follows and pressed down to them by the rows it is in
        (formulations/milp.md, "transient_alive")."""
        if lb > ub:
            raise ValueError(f"variable {name}: empty domain [{lb}, {ub}]")
        integral = (lb == 0 and ub == 1) if lp_integral is None else lp_integral
        self.vars.append(Var(len(self.vars), name, int(lb), int(ub), integral))
        return len(self.vars) - 1

    def binary(self, name: str) -> int:
        return self.var(name, 0, 1)

    def add(self, name: str, terms, lo=None, hi=None, enforce=()) -> None:
        merged: dict[int, int] = {}
        for v, c in terms:
            merged[v] = merged.get(v, 0) + int(c)
        clean = [(v, c) for v, c in merged.items() if c]
        self.constraints.append(
            Constraint(
                name,
                clean,
                None if lo is None else int(lo),
                None if hi is None else int(hi),
                tuple(enforce),
            )
        )

    def le(self, name, terms, hi, enforce=()) -> None:
        self.add(name, terms, None, hi, enforce)

    def ge(self, name, terms, lo, enforce=()) -> None:
        self.add(name, terms, lo, None, enforce)

    def eq(self, name, terms, value, enforce=()) -> None:
        self.add(name, terms, value, value, enforce)

    def bounds_of(self, terms) -> tuple[int, int]:
        lo = hi = 0
        for v, c in terms:
            var = self.vars[v]
            if c > 0:
                lo += c * var.lb
                hi += c * var.ub
            else:
                lo += c * var.ub
                hi += c * var.lb
        return lo, hi

    def first_violation(self, values: dict[int, int]) -> str | None:
        """The name of the first bound or constraint that ``values`` (a value for every variable)
        breaks, "incomplete" if a variable has none, or None: a feasible point."""
        if len(values) < len(self.vars) or any(v.index not in values for v in self.vars):
            return "incomplete"
        for v in self.vars:
            if not v.lb <= values[v.index] <= v.ub:
                return v.name
        for c in self.constraints:
            if any(values[e] != 1 for e in c.enforce):
                continue
            total = sum(coef * values[v] for v, coef in c.terms)
            if (c.lo is not None and total < c.lo) or (c.hi is not None and total > c.hi):
                return c.name
        return None

    def size(self) -> dict[str, int]:
        binaries = sum(1 for v in self.vars if v.lb == 0 and v.ub == 1)
        return {
            "variables": len(self.vars),
            "binaries": binaries,
            "constraints": len(self.constraints),
            "nonzeros": sum(len(c.terms) for c in self.constraints),
        }
