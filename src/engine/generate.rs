//! The generation core that the colocated [`Engine`](crate::Engine) and the
//! [`DecodeWorker`](crate::engine::DecodeWorker) share: each request's client
//! record (sampler, stream, canceller), the running sequences, the batched
//! decode pass, streaming a token, and ending a request exactly once with
//! its count. The engine adds admission, prefill and preemption on top; the
//! decode worker adds landing verified KV.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::engine::events::{self, EventSender};
use crate::engine::verify::{Proposal, verify};
use crate::engine::{Canceller, EngineError, FinishReason, Outcome, RequestHandle, Tally};
use crate::ids::RequestId;
use crate::kv::{Filling, KvSeq, Ready};
use crate::model::{ForwardError, Model, Scratch};
use crate::request::{Request, SpecConfig};
use crate::sampling::spec::Drafter;
use crate::sampling::{Draw, Sampler, SamplingError, TokenLogprobs};
use crate::sched::{Rejection, sampler_for};

/// A request known to a server (waiting, transferring or running).
struct Client {
    /// The request it serves: a slot is reused once its request ends, so a
    /// running sequence streams only to the record of its own id.
    id: RequestId,
    /// Tokens streamed so far (a preempted request recomputes them).
    generated: Vec<u32>,
    max_new: usize,
    sampler: Sampler,
    /// The client's stream, whose shared allocation also holds its cancel
    /// flag.
    tx: EventSender,
}

/// A request whose KV is complete (sealed by prefill, or verified on
/// landing), handed to the core to generate.
pub(crate) struct Started {
    pub(crate) req: Request,
    pub(crate) seq: KvSeq<Ready>,
    /// The token to feed at the first decode step.
    pub(crate) next: u32,
}

/// A request generating.
pub(crate) struct Running {
    pub(crate) req: Request,
    pub(crate) seq: KvSeq<Ready>,
    /// The token to feed at the next decode step.
    pub(crate) next: u32,
    /// Its client record's place in [`Generator::clients`]: a decode step
    /// streams to it without a lookup by id.
    slot: usize,
    /// Its drafter and the most tokens it drafts a step, when it decodes
    /// speculatively.
    drafter: Option<(Box<dyn Drafter>, usize)>,
}

/// What streaming one token did to its request.
pub(crate) enum Delivery {
    /// Streamed; this token is the next input.
    Continue(u32),
    /// The request ends with this outcome (the caller ends it).
    End(Outcome),
}

/// A decode pass that failed: every sequence in it has released its pages
/// (its KV may be half-written); the caller decides whether the requests
/// recompute or fail.
pub(crate) struct PassFailed {
    pub(crate) error: ForwardError,
    pub(crate) reqs: Vec<Request>,
}

/// The shared core. See the module documentation.
pub(crate) struct Generator<B: Backend> {
    pub(crate) model: Model<B>,
    pub(crate) scratch: Scratch<B>,
    /// Client records, each at a slot that stays its own while the request
    /// is live (freed slots are reused).
    clients: Vec<Option<Client>>,
    /// Free slots of `clients`.
    free: Vec<usize>,
    /// Each live request's slot.
    slots: HashMap<RequestId, usize>,
    /// In the order they started, oldest first.
    running: Vec<Running>,
    tokens: Vec<u32>,
    /// This step's draws, one per running request.
    draws: Vec<Draw>,
    /// This step's counts so far.
    step: Tally,
    /// Every finished step's counts.
    total: Tally,
    /// Speculative decoding for requests that do not choose.
    spec_default: Option<SpecConfig>,
    /// A request's history (prompt, then output), for its drafter.
    history: Vec<u32>,
}

impl<B: Backend> Generator<B> {
    pub(crate) fn new(model: Model<B>) -> Self {
        Generator {
            scratch: model.scratch(),
            model,
            clients: Vec::new(),
            free: Vec::new(),
            slots: HashMap::new(),
            running: Vec::new(),
            tokens: Vec::new(),
            draws: Vec::new(),
            step: Tally::default(),
            total: Tally::default(),
            spec_default: None,
            history: Vec::new(),
        }
    }

    /// Sets the speculative decoding of requests that do not choose.
    pub(crate) fn set_speculative(&mut self, spec: Option<SpecConfig>) {
        self.spec_default = spec;
    }

    /// True when no request is live.
    pub(crate) fn is_idle(&self) -> bool {
        self.slots.is_empty()
    }
    pub(crate) fn is_live(&self, id: RequestId) -> bool {
        self.slots.contains_key(&id)
    }
    /// The slot of `id`'s client record (tests of slot reuse).
    #[cfg(test)]
    pub(crate) fn slot_of(&self, id: RequestId) -> Option<usize> {
        self.slots.get(&id).copied()
    }
    fn client(&self, id: RequestId) -> Option<&Client> {
        self.clients.get(*self.slots.get(&id)?)?.as_ref()
    }
    fn client_mut(&mut self, id: RequestId) -> Option<&mut Client> {
        self.clients.get_mut(*self.slots.get(&id)?)?.as_mut()
    }
    pub(crate) fn running(&self) -> &[Running] {
        &self.running
    }
    /// Tokens `id` has streamed so far (empty if it is not live).
    pub(crate) fn generated(&self, id: RequestId) -> &[u32] {
        self.client(id).map_or(&[], |c| &c.generated)
    }
    /// Every step's counts so far (and rejected submissions).
    pub(crate) fn tally(&self) -> Tally {
        let mut t = self.total;
        t.add(&self.step);
        t
    }

    /// Ends the current step: returns its counts and adds them to the total.
    pub(crate) fn take_step(&mut self) -> Tally {
        let step = std::mem::take(&mut self.step);
        self.total.add(&step);
        step
    }
    /// The current step's counts, to add what only the caller knows.
    pub(crate) fn step_mut(&mut self) -> &mut Tally {
        &mut self.step
    }

    /// Registers an admitted request and returns its client's handle.
    fn register(&mut self, id: RequestId, max_new: usize, sampler: Sampler) -> RequestHandle {
        let (tx, events) = events::stream();
        let cancel = Canceller(tx.cancel_flag());
        let client = Client {
            id,
            generated: Vec::new(),
            max_new,
            sampler,
            tx,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.clients[slot] = Some(client);
                slot
            }
            None => {
                self.clients.push(Some(client));
                self.clients.len() - 1
            }
        };
        self.slots.insert(id, slot);
        RequestHandle::new(id, events, cancel)
    }

    /// Admits `req`: its sampling parameters, an id not live here, then
    /// `queue` (the server's own admission, which takes the request); on
    /// success registers the client. A refusal is counted and allocates
    /// nothing.
    pub(crate) fn admit(
        &mut self,
        req: Request,
        queue: impl FnOnce(Request) -> Result<(), Rejection>,
    ) -> Result<RequestHandle, Rejection> {
        let (id, max_new) = (req.id, req.max_new_tokens);
        let admitted = sampler_for(&req).and_then(|sampler| {
            // The id stays taken here until the request ends, so tokens of
            // one request can never reach another's handle.
            if self.is_live(id) {
                return Err(Rejection::DuplicateId { id });
            }
            queue(req)?;
            Ok(self.register(id, max_new, sampler))
        });
        if admitted.is_err() {
            self.total.rejected += 1;
        }
        admitted
    }

    /// Live requests whose client has cancelled (or dropped its handle).
    /// Walks the client records in slot order (one cache line each for the
    /// flag), not the id map, whose order is scattered.
    fn cancelled(&self) -> Vec<RequestId> {
        self.clients
            .iter()
            .flatten()
            .filter(|c| c.tx.is_cancelled())
            .map(|c| c.id)
            .collect()
    }
    /// Takes the live requests whose client has cancelled out of the
    /// running set (pages released, in one pass); returns each with whether
    /// it was running. The server drops the others from its own queues and
    /// ends them all.
    pub(crate) fn stop_cancelled(&mut self) -> Vec<(RequestId, bool)> {
        let ids = self.cancelled();
        if ids.is_empty() {
            return Vec::new();
        }
        let stopped = self.stop_running_each(&ids.iter().copied().collect());
        ids.into_iter()
            .map(|id| (id, stopped.contains(&id)))
            .collect()
    }
    /// Cancels `id` as its client would (an injected fault's cancel).
    pub(crate) fn cancel_as_client(&self, id: RequestId) {
        if let Some(c) = self.client(id) {
            c.tx.cancel_flag().set();
        }
    }

    /// Starts generating `s` (a request no longer live releases its pages
    /// instead: it ended meanwhile).
    pub(crate) fn start(&mut self, s: Started) {
        let Some(&slot) = self.slots.get(&s.req.id) else {
            s.seq.release();
            return;
        };
        let drafter = s
            .req
            .speculative
            .or(self.spec_default)
            .map(|c| (c.drafter(), c.k));
        self.running.push(Running {
            req: s.req,
            seq: s.seq,
            next: s.next,
            slot,
            drafter,
        });
    }
    /// Takes `id` out of the running set, pages released; its request back.
    pub(crate) fn stop_running(&mut self, id: RequestId) -> Option<Request> {
        let i = self.running.iter().position(|r| r.req.id == id)?;
        let r = self.running.remove(i);
        r.seq.release();
        Some(r.req)
    }
    /// Takes every running sequence whose id is in `ids` out of the running
    /// set in one pass (the others keep their order), pages released;
    /// returns the ids it took. Removing them one at a time shifted the
    /// running set once per request: quadratic when a thousand requests end
    /// or disconnect in one step.
    fn stop_running_each(&mut self, ids: &HashSet<RequestId>) -> HashSet<RequestId> {
        self.running
            .extract_if(.., |r| ids.contains(&r.req.id))
            .map(|r| {
                r.seq.release();
                r.req.id
            })
            .collect()
    }
    /// Takes every running sequence out, pages released; their requests back.
    pub(crate) fn stop_all_running(&mut self) -> Vec<Request> {
        std::mem::take(&mut self.running)
            .into_iter()
            .map(|r| {
                r.seq.release();
                r.req
            })
            .collect()
    }
    /// Makes room for one more token in every running sequence; returns the
    /// ids that could not grow (the pool disagreed with the plan).
    pub(crate) fn grow_running(&mut self) -> Vec<RequestId> {
        let mut stuck = Vec::new();
        for r in &mut self.running {
            let need = r.seq.complete_len().unwrap_or(0) + 1;
            if r.seq.ensure_capacity(need).is_err() {
                stuck.push(r.req.id);
            }
        }
        stuck
    }

    /// Streams a token another worker sampled for `id` (decode's first
    /// token, drawn by prefill from this request's random stream): the
    /// stream advances past it (a greedy sampler draws nothing; any other
    /// draws exactly once per token), so later tokens match colocated
    /// serving.
    pub(crate) fn deliver_drawn(
        &mut self,
        id: RequestId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
    ) -> Option<Delivery> {
        let c = self.client_mut(id)?;
        let _ = c.sampler.next_draw();
        Some(stream(c, token, logprobs))
    }

    /// Prefills `seqs` with `chunks` in one batched pass (each chunk
    /// appended after what its sequence holds). Where `finals[i]` names a
    /// request, the chunk ends its prompt: samples and streams its first
    /// token (`None` where the request is no longer live, and for every
    /// chunk that does not end a prompt). On a failed pass nothing is
    /// streamed.
    pub(crate) fn prefill(
        &mut self,
        seqs: &mut [&mut KvSeq<Filling>],
        chunks: &[&[u32]],
        finals: &[Option<RequestId>],
    ) -> Result<Vec<Option<Delivery>>, ForwardError> {
        // Each final chunk's request draws its first token (a greedy draw,
        // discarded, for the rest).
        let (slots, clients) = (&self.slots, &mut self.clients);
        let draws: Vec<Draw> = finals
            .iter()
            .map(|id| {
                let c = id
                    .as_ref()
                    .and_then(|id| slots.get(id))
                    .and_then(|&slot| clients.get_mut(slot)?.as_mut());
                c.map_or(Draw::greedy(), |c| c.sampler.next_draw())
            })
            .collect();
        let sampled = self
            .model
            .prefill_sampled(&mut self.scratch, seqs, chunks, &draws)?;
        let step = &mut self.step;
        step.prefilled += finals.iter().flatten().count() as u64;
        step.prefill_tokens += chunks.iter().map(|c| c.len() as u64).sum::<u64>();
        Ok(finals
            .iter()
            .zip(sampled)
            .enumerate()
            .map(|(i, (id, token))| {
                let c = clients.get_mut(*slots.get(id.as_ref()?)?)?.as_mut()?;
                Some(deliver(c, token.clone(), sampled.logprobs(i)))
            })
            .collect())
    }

    /// Decodes one token for every running sequence in one batched pass and
    /// ends those that finish; returns their ids (a server that tracks ids
    /// elsewhere, as the scheduler does, frees them).
    pub(crate) fn decode(&mut self) -> Result<Vec<RequestId>, PassFailed> {
        if self.running.is_empty() {
            return Ok(Vec::new());
        }
        let drafts = self.draft_all();
        if drafts.iter().any(|d| !d.is_empty()) {
            return self.decode_speculative(drafts);
        }
        self.tokens.clear();
        self.tokens.extend(self.running.iter().map(|r| r.next));
        self.draws.clear();
        for r in &self.running {
            let greedy = greedy_draw(&r.req);
            self.draws
                .push(next_draw(&mut self.clients, (r.slot, r.req.id, greedy)));
        }
        let result = {
            let mut refs: Vec<&mut KvSeq<Ready>> =
                self.running.iter_mut().map(|r| &mut r.seq).collect();
            self.model
                .decode_sampled(&mut self.scratch, &mut refs, &self.tokens, &self.draws)
        };
        let sampled = match result {
            Ok(l) => l,
            Err(error) => return Err(self.pass_failed(error)),
        };
        self.step.decoded += self.running.len() as u64;
        let mut ended = Vec::new();
        for (i, r) in self.running.iter_mut().enumerate() {
            let client = self.clients.get_mut(r.slot).and_then(Option::as_mut);
            let Some(c) = client.filter(|c| c.id == r.req.id) else {
                continue;
            };
            match deliver(c, sampled[i].clone(), sampled.logprobs(i)) {
                Delivery::Continue(next) => r.next = next,
                Delivery::End(outcome) => ended.push((r.req.id, outcome)),
            }
        }
        Ok(self.end_each(ended))
    }

    /// Takes the requests in `ended` out of the running set (pages
    /// released) and ends each with its outcome; returns their ids.
    fn end_each(&mut self, ended: Vec<(RequestId, Outcome)>) -> Vec<RequestId> {
        if !ended.is_empty() {
            self.stop_running_each(&ended.iter().map(|&(id, _)| id).collect());
        }
        let mut ids = Vec::with_capacity(ended.len());
        for (id, outcome) in ended {
            self.end(id, outcome);
            ids.push(id);
        }
        ids
    }

    /// Each running sequence's drafts for this step (empty for one that
    /// does not draft, has no guess, or has one token left to generate).
    fn draft_all(&mut self) -> Vec<Vec<u32>> {
        let (clients, history) = (&self.clients, &mut self.history);
        self.running
            .iter_mut()
            .map(|r| {
                let mut out = Vec::new();
                let Some((drafter, k)) = r.drafter.as_mut() else {
                    return out;
                };
                let Some(c) = clients
                    .get(r.slot)
                    .and_then(Option::as_ref)
                    .filter(|c| c.id == r.req.id)
                else {
                    return out;
                };
                // The last token emitted is generated too: never draft
                // past the request's last token.
                let k = (*k).min(c.max_new.saturating_sub(c.generated.len() + 1));
                if k == 0 {
                    return out;
                }
                history.clear();
                history.extend_from_slice(&r.req.prompt);
                history.extend_from_slice(&c.generated);
                drafter.draft(history, k, &mut out);
                out.truncate(k);
                out
            })
            .collect()
    }

    /// [`Generator::decode`] with drafts: every running sequence (those
    /// without drafts too) in one verify pass; each streams the tokens the
    /// acceptance rule emits, one draw spent per token.
    fn decode_speculative(&mut self, drafts: Vec<Vec<u32>>) -> Result<Vec<RequestId>, PassFailed> {
        let who: Vec<(usize, RequestId, Option<Draw>)> = self
            .running
            .iter()
            .map(|r| (r.slot, r.req.id, greedy_draw(&r.req)))
            .collect();
        let clients = &mut self.clients;
        let draw = |i: usize| next_draw(clients, who[i]);
        let result = {
            let mut props: Vec<Proposal<'_>> = self
                .running
                .iter_mut()
                .zip(drafts)
                .map(|(r, drafts)| Proposal {
                    seq: &mut r.seq,
                    next: r.next,
                    drafts,
                })
                .collect();
            verify(&self.model, &mut self.scratch, &mut props, draw)
        };
        let verdicts = match result {
            Ok(v) => v,
            Err(error) => return Err(self.pass_failed(error)),
        };
        self.step.decoded += self.running.len() as u64;
        let mut ended = Vec::new();
        for (r, v) in self.running.iter_mut().zip(verdicts) {
            self.step.drafted += v.drafted as u64;
            self.step.accepted += v.accepted() as u64;
            let client = self.clients.get_mut(r.slot).and_then(Option::as_mut);
            let Some(c) = client.filter(|c| c.id == r.req.id) else {
                continue;
            };
            for (token, logprobs) in v.tokens.into_iter().zip(v.logprobs) {
                match deliver(c, token, logprobs.as_ref()) {
                    Delivery::Continue(next) => r.next = next,
                    Delivery::End(outcome) => {
                        ended.push((r.req.id, outcome));
                        break;
                    }
                }
            }
        }
        Ok(self.end_each(ended))
    }

    /// A failed pass: every running sequence released, their requests back.
    fn pass_failed(&mut self, error: ForwardError) -> PassFailed {
        let reqs = self.stop_all_running();
        PassFailed { error, reqs }
    }

    /// Sends `id`'s final outcome, counts it, and forgets the client.
    /// False if `id` was not live (it ended already).
    pub(crate) fn end(&mut self, id: RequestId, outcome: Outcome) -> bool {
        let Some(slot) = self.slots.remove(&id) else {
            return false;
        };
        let Some(c) = self.clients.get_mut(slot).and_then(Option::take) else {
            return false;
        };
        self.free.push(slot);
        self.step.count(&outcome);
        c.tx.done(outcome);
        true
    }

    /// Ends every live request with `outcome_for(id, generated)`; returns
    /// their ids.
    pub(crate) fn end_all(
        &mut self,
        mut outcome_for: impl FnMut(RequestId, &[u32]) -> Outcome,
    ) -> Vec<RequestId> {
        let ids: Vec<RequestId> = self.slots.keys().copied().collect();
        for &id in &ids {
            let outcome = outcome_for(id, self.generated(id));
            self.end(id, outcome);
        }
        ids
    }
}

/// A greedy request's draw (it spends nothing), `None` for one that samples.
fn greedy_draw(req: &Request) -> Option<Draw> {
    req.sampling
        .is_greedy()
        .then(|| Draw::greedy_for(&req.sampling))
}

/// The next draw of the request at `slot` with `id`: `greedy` when it is
/// greedy (no need to visit its client), else its sampler's next.
fn next_draw(
    clients: &mut [Option<Client>],
    (slot, id, greedy): (usize, RequestId, Option<Draw>),
) -> Draw {
    if let Some(d) = greedy {
        return d;
    }
    clients
        .get_mut(slot)
        .and_then(Option::as_mut)
        .filter(|c| c.id == id)
        .map_or(Draw::greedy(), |c| c.sampler.next_draw())
}

/// Streams `c`'s sampled token (with its log-probabilities when the
/// request asked), or ends it on a sampling error.
fn deliver(
    c: &mut Client,
    token: Result<u32, SamplingError>,
    logprobs: Option<&TokenLogprobs>,
) -> Delivery {
    match token {
        Ok(token) => stream(c, token, logprobs.cloned()),
        Err(e) => Delivery::End(Outcome::Failed(EngineError::Sampling(e))),
    }
}

/// Streams `token` to `c`'s client and says whether its request goes on.
fn stream(c: &mut Client, token: u32, logprobs: Option<TokenLogprobs>) -> Delivery {
    c.generated.push(token);
    // Only a request that asked gets them (the pass computes them only for
    // its draws; this keeps a stale one from reaching another request).
    let logprobs = logprobs.filter(|_| c.sampler.params().logprobs.is_some());
    if c.tx.token(token, logprobs).is_err() {
        // The client is gone: stop spending pages on it.
        return Delivery::End(Outcome::Cancelled);
    }
    if c.sampler.is_stop(token) {
        Delivery::End(Outcome::Finished(FinishReason::Stop(token)))
    } else if c.generated.len() >= c.max_new {
        Delivery::End(Outcome::Finished(FinishReason::Length))
    } else {
        Delivery::Continue(token)
    }
}

/// A server stepped by its owner: the colocated engine or a decode worker.
pub(crate) trait Steps {
    fn idle(&self) -> bool;
    fn step_once(&mut self) -> Tally;
    /// True when a step that did nothing means no later step will either
    /// (a colocated engine waits on nobody; a decode worker waits on its
    /// peer, so an empty step is normal there).
    fn stalled(&self, step: &Tally) -> bool;
}

/// Steps `s` until no request is live, a step stalls, or `limit` passes.
/// Returns the steps taken and whether `s` is idle.
pub(crate) fn run_until_idle<S: Steps>(s: &mut S, limit: Option<Duration>) -> (usize, bool) {
    let start = Instant::now();
    let mut steps = 0;
    while !s.idle() {
        if limit.is_some_and(|l| start.elapsed() >= l) {
            return (steps, false);
        }
        steps += 1;
        let step = s.step_once();
        if s.stalled(&step) {
            break;
        }
    }
    (steps, s.idle())
}
