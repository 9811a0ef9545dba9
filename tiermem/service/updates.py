"""How the service takes a committed update: its own share (the CPU AdamW), the trainer's GPU worker's
share (``alloc`` places for a group's new state, ``flip`` once it is written: journal, switch, publish),
the groups it takes over for want of room, and what a trainer that leaves still owed. A part of
``Service`` (``tiermem.service.server``), which holds ``lock``, ``say`` and the runs."""

from __future__ import annotations

import concurrent.futures as cf
import statistics

from tiermem.service.hbm import hbm_groups
from tiermem.service.journal import write_atomic
from tiermem.service.planning import SPLIT_AFTER, split_again
from tiermem.service.requests import RequestError, field_of, finite_of, is_key
from tiermem.service.runs import Client, Run
from tiermem.store.layout import layout_of
from tiermem.tiers.extents import OutOfSpace


class UpdateRequests:
    def _commit(self, client: Client, msg: dict) -> dict:
        run = self._attached(client, msg)
        step = field_of(msg, "step", int)
        lr = finite_of(msg, "lr")
        scale = None if msg.get("grad_scale") is None else finite_of(msg, "grad_scale")
        with self.lock:
            st = run.state
            if not st.initialized:
                raise RequestError("commit before init: load the weights first")
            if step != st.committed + 1:
                raise RequestError(f"out of order: commit of step {step} but the next step is {st.committed + 1}")
            if run.error:
                raise RequestError(f"the optimizer failed: {run.error}; fix the cause and restart the service: "
                                   "it recovers the last committed step")
            grant = msg.get("grant")  # (the first groups the trainer writes out of place: their places in the reply)
            if grant is not None and (not isinstance(grant, list) or len(grant) > 4):
                raise RequestError("grant: a list of at most 4 groups")  # (before anything is journaled)
            run.wait()  # the last update is whole (its last journal line may still be on its way)
            moved = self._move_state(run) if self.pending_config is not None else False
            run.journal.compact()
            for g in run.optimizer.groups:
                run.store.mark_valid(g, "grad")
            run.journal.append("commit", sync=True, step=step, lr=lr, grad_scale=scale)
            opt = run.optimizer
            if run.next_split is not None:  # (told with the last commit's reply: the trainer's backward kept to it)
                opt.resplit(run.next_split | hbm_groups(run.store))
                client.groups = frozenset(opt.on_gpu)
                run.plan.gpu_updates, run.next_split = set(opt.on_gpu), None
                run.record.setdefault("plan", {})["gpu_updates"] = sorted(opt.on_gpu, key=str)
                write_atomic(self.record_path, run.record)  # (a restarted service splits as this one did)
            with run.update_lock:
                run.owed = set(opt.on_gpu)  # the trainer's GPU worker updates these (alloc, flip)
                run.own_done = False
                run.pending = cf.Future()
            fut = opt.step(step, lr, scale, only=set(opt.groups) - run.owed)
            fut.add_done_callback(lambda f, run=run, step=step: self._updated(run, step, f))
            reply = {"layout": layout_of(run.store)} if moved else {}
            if grant is not None:
                reply["places"] = [self._grant(client, dict(msg, group=g))["places"] for g in grant]
            if run.plan is not None and not run.split_tried and len(run.cpu_seen) >= SPLIT_AFTER and run.world == 1 \
                    and client.groups:
                self._split_again(run, reply)
        return reply

    def _split_again(self, run: Run, reply: dict) -> None:
        """Once the service's CPU worker has done SPLIT_AFTER updates: where its rate is off the plan's, the split of
        the updates for that rate (``split_again``), told to the trainer now (``next_split``: its next backward keeps
        those groups' gradients on its GPU) and taken by both at the next commit (call with the lock held)."""
        run.split_tried = True
        found = split_again(run.plan, run.cpu_seen)
        if found is None:
            return
        found = set(found) | hbm_groups(run.store)  # (as the service's optimizer takes it)
        run.next_split = found
        n, seen = len(found), statistics.median(run.cpu_seen[-SPLIT_AFTER:])
        self.say(f"the CPU worker's updates took {seen:.2f}s, {run.plan.prediction.busy.get('cpu', 0.0):.2f}s "
                 f"planned: from the next update the trainer's GPU worker updates {n} group{'s' if n != 1 else ''}, "
                 f"the service's CPU {len(run.optimizer.groups) - n}")
        reply["next_split"] = [g for g in run.optimizer.groups if g in found]

    def _updated(self, run: Run, step: int, fut) -> None:
        """The service's part of update ``step`` ended."""
        if fut.exception() is not None:
            self._failed(run, step, fut.exception())
            return
        seconds, split = run.optimizer.update_figures()
        cpu = split.get("cpu_adamw", 0.0) + split.get("cpu_compute_copy", 0.0)
        if cpu > 0 and len(run.cpu_seen) < SPLIT_AFTER:
            run.cpu_seen.append(cpu)
        run.updates += 1
        for k, v in {"total": seconds, **split}.items():
            run.update_seconds[k] = run.update_seconds.get(k, 0.0) + v
        with run.update_lock:
            run.own_done = True
            self._maybe_updated(run, step)

    def _failed(self, run: Run, step: int, err: BaseException) -> None:
        run.error = f"{type(err).__name__}: {err}"
        self.say(f"update {step} failed: {run.error}")
        self._tell_all(run, {"ev": "failed", "error": run.error})
        with run.update_lock:
            if run.pending is not None and not run.pending.done():
                run.pending.set_result(None)

    def _maybe_updated(self, run: Run, step: int) -> None:
        """Journal update ``step`` whole once both its parts are (call with ``run.update_lock`` held)."""
        if run.own_done and not run.owed and not run.taken and run.pending is not None and not run.pending.done():
            run.journal.append("updated", step=step)
            run.pending.set_result(None)

    def _owed(self, client: Client, msg: dict) -> tuple[Run, object, int]:
        run = self._attached(client, msg, any_rank=True)
        step, g = field_of(msg, "step", int), msg.get("group")
        if not is_key(g) or step != run.state.committed or g not in run.owed or g not in client.groups:
            raise RequestError(f"group {str(g)[:40]!r} is not owed by the trainer for update {step}")
        return run, g, step

    def _take_over(self, run: Run, g, step: int) -> None:
        """The service updates owed group ``g`` on its CPU worker (call with the lock held)."""
        st = run.state
        with run.update_lock:
            run.owed.discard(g)
            run.taken.add(g)
            run.taken_count += 1
        fut = run.optimizer.update_on_cpu([g], step, st.commit_args["lr"], st.commit_args["grad_scale"])

        def done(f, run=run, g=g):
            if f.exception() is not None:
                self._failed(run, step, f.exception())
                return
            with run.update_lock:
                run.taken.discard(g)
                self._maybe_updated(run, step)

        fut.add_done_callback(done)

    def _flip(self, client: Client, msg: dict) -> dict:
        """The trainer wrote a group's update where ``alloc`` said: journal it, make it the home, publish. With
        ``next`` (a group the trainer owes), then as ``alloc`` for that group, in the same reply: the trainer's GPU
        worker asks for a group's places as soon as the flip two groups before it frees room, without a round trip
        of its own between groups."""
        with self.lock:
            run, g, step = self._owed(client, msg)
            step_of, places = run.grants.get(g, (None, {}))
            given = msg.get("places")
            if step_of != step or not isinstance(given, dict) or \
                    {n: [ext.offset, ext.nbytes] for n, (_, ext) in places.items()} != given:
                raise RequestError(f"flip of group {str(g)[:40]!r} to places the service did not allocate")
            del run.grants[g]
            run.guard.flip(g, step, {n: ext for n, (_, ext) in places.items()})
            run.store.catalog.bump(g, to=step)
            with run.update_lock:
                run.owed.discard(g)
                self._maybe_updated(run, step)
            if msg.get("next") is None:
                return {}
            return self._grant(client, dict(msg, group=msg["next"]))

    def _alloc(self, client: Client, msg: dict) -> dict:
        """Places for the new master weights and moments of a group the trainer updates out of place. With
        no room for them (a fragmented arena) the service takes the group: its CPU worker updates it in
        place behind the undo copy, and the reply says so (places: null)."""
        with self.lock:
            return self._grant(client, msg)

    def _grant(self, client: Client, msg: dict) -> dict:
        """``alloc``'s work (call with the lock held)."""
        run, g, step = self._owed(client, msg)
        store, old = run.store, run.grants.pop(g, None)
        if old is not None:
            self._free_grant(run, old)
        names = run.optimizer.state_names(g)
        try:
            places = store.allocate_elsewhere(names)
        except OutOfSpace as e:
            if not run.taken_count:  # (said once a run: the finish line counts them)
                self.say(f"update {step}: no room for group {g}'s new state ({e}); the service updates such a "
                         f"group itself, in place (slower){grants_note(run.grants)}")
            self._take_over(run, g, step)
            return {"places": None}
        run.grants[g] = (step, {n: (store.catalog[n].tier, places[n]) for n in names})
        return {"places": {n: [ext.offset, ext.nbytes] for n, ext in places.items()}}

    def _free_grant(self, run: Run, grant) -> None:
        for tier, ext in grant[1].values():
            run.store.tier(tier).free(ext)

    def _trainer_left(self, run: Run) -> None:
        """The trainer is gone (call with the lock held): its unfinished share of the committed update is
        the service's now."""
        for grant in run.grants.values():
            self._free_grant(run, grant)
        run.grants = {}
        if not run.owed or run.error:
            return
        st, todo = run.state, set(run.owed)
        self.say(f"finishing update {st.committed} of {len(todo)} groups the trainer left")
        fut = run.optimizer.step(st.committed, st.commit_args["lr"], st.commit_args["grad_scale"], only=todo)

        def redone(f, run=run, step=st.committed):
            if f.exception() is not None:
                self._failed(run, step, f.exception())
                return
            with run.update_lock:
                run.owed.clear()
                self._maybe_updated(run, step)

        fut.add_done_callback(redone)


def grants_note(grants: dict) -> str:
    """What the trainers hold of the room for new state when one found none (the groups granted places)."""
    return f"; places held for group{'s' if len(grants) != 1 else ''} {', '.join(map(str, grants))}" if grants else ""
