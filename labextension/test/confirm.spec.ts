/**
 * The delete buttons' second click: the first arms the button for CONFIRM_MS, a second on
 * the same snapshot within that time confirms, anything else starts over.
 */
import { CONFIRM_MS, DeleteButtons } from '../src/confirm';

describe('DeleteButtons', () => {
  beforeEach(() => jest.useFakeTimers());
  afterEach(() => jest.useRealTimers());

  it('confirms the second click on the same snapshot, and redraws when it arms', () => {
    const changed = jest.fn();
    const buttons = new DeleteButtons(changed);
    expect(buttons.confirms('s1')).toBe(false);
    expect(buttons.armed).toBe('s1');
    expect(changed).toHaveBeenCalledTimes(1);
    expect(buttons.confirms('s1')).toBe(true);
    expect(buttons.armed).toBeNull();
  });

  it('arms another snapshot instead of confirming', () => {
    const buttons = new DeleteButtons(() => undefined);
    buttons.confirms('s1');
    expect(buttons.confirms('s2')).toBe(false);
    expect(buttons.armed).toBe('s2');
  });

  it('disarms after CONFIRM_MS, and a click then arms again', () => {
    const changed = jest.fn();
    const buttons = new DeleteButtons(changed);
    buttons.confirms('s1');
    jest.advanceTimersByTime(CONFIRM_MS);
    expect(buttons.armed).toBeNull();
    expect(changed).toHaveBeenCalledTimes(2);
    expect(buttons.confirms('s1')).toBe(false);
  });
});
